"""`mooncake bench`: a load generator for OpenAI-compatible endpoints. Base code: HTTP only."""
