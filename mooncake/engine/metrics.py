"""A worker's Prometheus metrics, on prometheus_client.

Each WorkerMetrics owns its own CollectorRegistry (never the library's global one), so two
workers in one process, or two tests, never share values. The request counters and the
first-token histogram live in that registry. The load gauges and the connector's counters are
not instruments: they are read fresh at each scrape and handed to `render`, which wraps them in
one-shot collectors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Connector counters (ConnectorStats field -> metric name, help text). prometheus_client drops the
# `_total` from a counter family's name and puts it back on the sample, so the exposed name is this one.
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
# WorkerState.load() field -> gauge name, help text.
_LOAD_GAUGES = {
    "running_requests": ("mooncake_worker_running_requests", "Requests in the engine now."),
    "queued_prefill_tokens": ("mooncake_worker_queued_prefill_tokens", "Prompt tokens not yet prefilled (tokens)."),
}


class LoadGauges:
    """The worker's load (from WorkerState.load(), read at scrape time) as gauges."""

    def __init__(self, load: dict):
        self._load = load

    def collect(self):
        for key, (name, help_text) in _LOAD_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=self._load[key])


class ConnectorCounters:
    """The connector's cumulative stats (fetched over the control channel at scrape time) as
    counters. A field the connector did not report (or all of them, when it did not answer) is
    left out rather than shown as zero: a counter that drops to zero would read as a reset."""

    def __init__(self, stats: dict):
        self._stats = stats

    def collect(self):
        for key, (name, help_text) in _KV_COUNTERS.items():
            if key in self._stats:
                yield CounterMetricFamily(name, help_text, value=self._stats[key])


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # Counter names omit `_total`: prometheus_client appends it to the sample it exposes.
        self.requests = Counter("mooncake_worker_requests", "Requests finished by this worker, by outcome.",
                                ["outcome"], registry=self.registry)
        self.prompt_tokens = Counter("mooncake_worker_prompt_tokens", "Prompt tokens received (tokens).",
                                     registry=self.registry)
        self.generated_tokens = Counter("mooncake_worker_generated_tokens", "Tokens generated (tokens).",
                                        registry=self.registry)
        self.first_token = Histogram("mooncake_worker_first_token_seconds",
                                     "Arrival to first token on this worker (seconds).",
                                     buckets=_TTFT_BUCKETS_S, registry=self.registry)

    def render(self, load: dict, kv: dict) -> bytes:
        """The Prometheus text for one scrape: the instruments plus `load` and `kv`, read by the
        caller just now. The scrape's registry is thrown away after; only self.registry persists."""
        scrape = CollectorRegistry()
        scrape.register(self.registry)
        scrape.register(LoadGauges(load))
        scrape.register(ConnectorCounters(kv))
        return generate_latest(scrape)
