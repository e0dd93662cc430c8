"""A worker's Prometheus metrics, on prometheus_client.

Each WorkerMetrics owns its own CollectorRegistry (never the library's global one), so two
workers in one process, or two tests, never share values. The request counters and the
first-token histogram live in that registry, and so do the engine's own figures (its running
batch, its queue, its KV cache usage, the tokens it prefilled and decoded), which vLLM hands to
EngineStatLogger after each engine step. The load gauges, the connector's counters and the
messenger's are not instruments: they are read fresh at each scrape and handed to `render`,
which wraps them in one-shot collectors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from mooncake.prometheus_text import WithoutCreated

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
# Where the KV of a prompt token the engine did not compute came from (vLLM's PromptTokenStats).
CACHE_SOURCES = ("local_cache_hit", "external_kv_transfer")
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


class MessengerMetrics:
    """The messenger's transport counters (messenger/stats.py snapshots, by transport, fetched
    with the connector's stats at scrape time) as a byte counter and a request latency
    histogram per transport. Left out, like the connector's, when the connector did not answer."""

    def __init__(self, transports: dict):
        self._transports = transports

    def collect(self):
        if not self._transports:
            return
        moved = CounterMetricFamily("mooncake_messenger_bytes", "Bytes moved by the KV messenger (frames whole: "
                                    "prefix, header, payload), by transport and direction (sent, received).",
                                    labels=["transport", "direction"])
        latency = HistogramMetricFamily(
            "mooncake_messenger_request_seconds", "Round trip of one messenger request, from the first byte sent "
            "to the reply (a pushed KV layer: send, the receiver's checksum and staging, the acknowledgement; "
            "transport=\"lane\": a call on its call lane; seconds).", labels=["transport"])
        for transport, snap in sorted(self._transports.items()):
            moved.add_metric([transport, "sent"], snap["sent_bytes"])
            moved.add_metric([transport, "received"], snap["received_bytes"])
            seconds = snap["request_seconds"]
            buckets = [(_le(bound), count) for bound, count in zip(seconds["le"], seconds["cumulative"])]
            latency.add_metric([transport], buckets + [("+Inf", seconds["count"])], sum_value=seconds["sum"])
        yield moved
        yield latency


class PoolMetrics:
    """The node's KVCache pool (store/service.py stats(), read at scrape time): capacity, use and
    blocks per tier as gauges, its counters (evictions, spills, promotions, corrupt blocks, SSD
    errors) as counters. Nothing when the worker runs without a pool."""

    _COUNTER_HELP = "Events of the KVCache pool, by kind (evictions, spills, promotions, corrupt blocks, SSD errors)."

    def __init__(self, stats: dict):
        self._stats = stats

    def collect(self):
        usage = self._stats.get("usage") or {}
        if not usage:
            return
        gauges = {
            "capacity_bytes": GaugeMetricFamily("mooncake_store_capacity_bytes", "Capacity of each tier of the "
                                                "KVCache pool (bytes).", labels=["tier"]),
            "used_bytes": GaugeMetricFamily("mooncake_store_used_bytes", "Bytes of each tier of the KVCache pool "
                                            "in use, blocks being written included (bytes).", labels=["tier"]),
            "blocks": GaugeMetricFamily("mooncake_store_blocks", "Blocks each tier of the KVCache pool can serve "
                                        "(blocks).", labels=["tier"]),
        }
        for tier, figures in sorted(usage.items()):
            for key, family in gauges.items():
                family.add_metric([tier], figures.get(key, 0))
        yield from gauges.values()
        events = CounterMetricFamily("mooncake_store_events", self._COUNTER_HELP, labels=["kind"])
        for kind, value in sorted((self._stats.get("counters") or {}).items()):
            events.add_metric([kind], value)
        yield events


def _le(bound: float) -> str:
    return repr(float(bound))  # prometheus_client's own spelling of a bucket bound: 0.001, 1.0


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
        # The engine's own figures (EngineStatLogger sets them after each engine step).
        self.engine_running = Gauge("mooncake_worker_engine_running_requests",
                                    "Requests in the engine's running batch (vLLM's scheduler).", registry=self.registry)
        self.engine_waiting = Gauge("mooncake_worker_engine_waiting_requests",
                                    "Requests waiting in the engine's queue (vLLM's scheduler).", registry=self.registry)
        self.kv_cache_usage = Gauge("mooncake_worker_kv_cache_usage_ratio",
                                    "Fraction of the engine's KV cache blocks in use (ratio, 0 to 1).",
                                    registry=self.registry)
        self.prefill_tokens = Counter(
            "mooncake_worker_prefill_tokens", "Prompt tokens the engine computed: neither found in its prefix "
            "cache nor loaded by a KV connector (pushed KV, the KVCache pool) (tokens; rate() is prefill tokens "
            "per second).", registry=self.registry)
        self.decode_tokens = Counter(
            "mooncake_worker_decode_tokens", "Tokens the engine generated (tokens; rate() is decode tokens per "
            "second).", registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "mooncake_worker_cached_prompt_tokens", "Prompt tokens the engine did not compute, by where their KV "
            "came from: local_cache_hit (its own prefix cache), external_kv_transfer (loaded by a KV connector: "
            "pushed by a prefill worker or loaded from the KVCache pool (DRAM, SSD, another node)) (tokens).",
            ["source"], registry=self.registry)
        for source in CACHE_SOURCES:
            self.cached_prompt_tokens.labels(source=source)

    def render(self, load: dict, kv: dict, messenger: dict | None = None, pool: dict | None = None) -> bytes:
        """The Prometheus text for one scrape: the instruments plus `load`, `kv` and `messenger`
        (transport -> snapshot), read by the caller just now. The scrape's registry is thrown away
        after; only self.registry persists."""
        scrape = CollectorRegistry()
        scrape.register(self.registry)
        scrape.register(LoadGauges(load))
        scrape.register(ConnectorCounters(kv))
        scrape.register(MessengerMetrics(messenger or {}))
        scrape.register(PoolMetrics(pool or {}))
        return generate_latest(WithoutCreated(scrape))
