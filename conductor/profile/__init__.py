"""`mooncake profile`: measure a real vLLM engine and write a profile table for the estimators."""
