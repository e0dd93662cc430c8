"""The engine's own figures, taken from vLLM's stat logger hook into the worker's metrics.

AsyncLLM calls every stat logger it was built with after each batch of engine outputs, in this
(the worker shell's) process, with the engine core's SchedulerStats (running batch, waiting
queue, KV cache usage) and the IterationStats of that batch (tokens prefilled, cached, decoded).
EngineStatLogger copies them into WorkerMetrics, so /metrics shows what vLLM's scheduler saw
rather than what the shell guesses. vLLM's own Prometheus logger still runs, into
prometheus_client's global registry, which /metrics does not serve.

vLLM calls the logger by duck typing (PerEngineStatLoggerAdapter calls record, log,
log_engine_initialized), so this module does not import vLLM; vLLM documents SchedulerStats and
IterationStats as unstable, so every field is read with a default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mooncake.engine.metrics import WorkerMetrics


class EngineStatLogger:
    """One engine's stat logger (vLLM's StatLoggerBase interface) writing into `metrics`."""

    def __init__(self, metrics: WorkerMetrics):
        self._metrics = metrics

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        m = self._metrics
        if scheduler_stats is not None:
            m.engine_running.set(getattr(scheduler_stats, "num_running_reqs", 0))
            # Deferred requests (waiting on KV that is still arriving, say) are waiting too.
            m.engine_waiting.set(getattr(scheduler_stats, "num_waiting_reqs", 0)
                                 + getattr(scheduler_stats, "num_skipped_waiting_reqs", 0))
            m.kv_cache_usage.set(getattr(scheduler_stats, "kv_cache_usage", 0.0))
        if iteration_stats is not None:
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None:
                m.prefill_tokens.inc(prompt.computed)
                m.cached_prompt_tokens.labels(source="local_cache_hit").inc(prompt.local_cache_hit)
                m.cached_prompt_tokens.labels(source="external_kv_transfer").inc(prompt.external_kv_transfer)
            m.decode_tokens.inc(getattr(iteration_stats, "num_generation_tokens", 0))

    def log(self) -> None:
        """vLLM's periodic log call: nothing to print, the figures are scraped."""

    def log_engine_initialized(self) -> None:
        """Called once the engine is up: nothing to do."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """Sleep mode is not used here."""


def engine_stat_logger(metrics: WorkerMetrics) -> Callable[[Any, int], EngineStatLogger]:
    """A per-engine stat logger factory for AsyncLLM(stat_loggers=[...]): vLLM calls it with
    (vllm_config, engine_index)."""
    return lambda vllm_config, engine_index: EngineStatLogger(metrics)
