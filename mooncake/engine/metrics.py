"""A worker's Prometheus metrics (owned by its app state; no global registry)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake.promtext import Counter, Histogram, gauge

_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Connector counters (ConnectorStats field -> metric name, help text).
_KV_COUNTERS = {
    "pushed_transfers": ("mooncake_kv_pushed_transfers_total", "Prompts whose KV this worker pushed."),
    "pushed_bytes": ("mooncake_kv_pushed_bytes_total", "KV bytes pushed (bytes)."),
    "push_failures": ("mooncake_kv_push_failures_total", "Pushes that failed (the receiver recomputes)."),
    "push_seconds": ("mooncake_kv_push_seconds_total", "Time spent pushing layers (seconds)."),
    "loaded_transfers": ("mooncake_kv_loaded_transfers_total", "Pushed prompts loaded into the paged cache."),
    "loaded_tokens": ("mooncake_kv_loaded_tokens_total", "Prompt tokens loaded instead of computed (tokens)."),
    "loaded_bytes": ("mooncake_kv_loaded_bytes_total", "KV bytes loaded (bytes)."),
    "load_seconds": ("mooncake_kv_load_seconds_total", "Time spent copying staged KV in (seconds)."),
    "load_failures": ("mooncake_kv_load_failures_total", "Loads that failed and were recomputed."),
    "load_timeouts": ("mooncake_kv_load_timeouts_total", "Loads whose KV never arrived in time."),
    "checksum_failures": ("mooncake_kv_checksum_failures_total", "Layers refused for a bad checksum."),
}


@dataclass
class WorkerMetrics:
    requests: Counter = field(default_factory=lambda: Counter(
        "mooncake_worker_requests_total", "Requests finished by this worker, by outcome."))
    prompt_tokens: Counter = field(default_factory=lambda: Counter(
        "mooncake_worker_prompt_tokens_total", "Prompt tokens received (tokens)."))
    generated_tokens: Counter = field(default_factory=lambda: Counter(
        "mooncake_worker_generated_tokens_total", "Tokens generated (tokens)."))
    first_token: Histogram = field(default_factory=lambda: Histogram(
        "mooncake_worker_first_token_seconds", "Arrival to first token on this worker (seconds).",
        _TTFT_BUCKETS_S))

    def render(self, load: dict, kv: dict) -> str:
        lines: list[str] = []
        for inst in (self.requests, self.prompt_tokens, self.generated_tokens, self.first_token):
            lines += inst.render()
        lines += gauge("mooncake_worker_running_requests", "Requests in the engine now.", load["running_requests"])
        lines += gauge("mooncake_worker_queued_prefill_tokens", "Prompt tokens not yet prefilled (tokens).",
                       load["queued_prefill_tokens"])
        for key, (name, help_text) in _KV_COUNTERS.items():
            if key in kv:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {kv[key]:g}"]
        return "\n".join(lines) + "\n"
