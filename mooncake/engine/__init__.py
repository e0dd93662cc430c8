"""The worker shell shared by prefill/ and decode/: one vLLM engine behind a small internal API."""
