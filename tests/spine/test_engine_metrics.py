"""The worker's engine figures (mooncake/engine/stat_logger.py) and the messenger's transport
counters (messenger/stats.py) as they reach /metrics. The stat logger gets stand-ins shaped like
vLLM's SchedulerStats and IterationStats (importing vLLM takes tens of seconds); the real engine
feeds it in tests/e2e/test_metrics_counts.py. The messenger is the real one, on loopback."""

import time
from types import SimpleNamespace

import pytest

from messenger.stats import TransportStats
from mooncake.engine.metrics import WorkerMetrics
from mooncake.engine.stat_logger import engine_stat_logger
from tests.spine.test_worker_metrics import LOAD, parse


def scheduler_stats(running, waiting, skipped, usage):
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting, num_skipped_waiting_reqs=skipped,
                           kv_cache_usage=usage)


def iteration_stats(computed, local, external, generated):
    prompt = SimpleNamespace(computed=computed, local_cache_hit=local, external_kv_transfer=external)
    return SimpleNamespace(prompt_token_stats=prompt, num_generation_tokens=generated)


def test_stat_logger_sets_the_engine_gauges_and_counts_tokens():
    metrics = WorkerMetrics()
    logger = engine_stat_logger(metrics)(None, 0)  # how vLLM calls a per-engine factory
    logger.log_engine_initialized()
    logger.record(scheduler_stats(3, 2, 1, 0.25), iteration_stats(100, 32, 0, 1), engine_idx=0)
    logger.record(None, iteration_stats(0, 0, 256, 4))  # an output batch without scheduler stats
    logger.record(scheduler_stats(1, 0, 0, 0.5), None)
    logger.log()
    families = parse(metrics.render(LOAD, {}).decode())
    assert families["mooncake_worker_engine_running_requests"] == (
        "gauge", {("mooncake_worker_engine_running_requests", ()): 1})
    assert families["mooncake_worker_engine_waiting_requests"][1] == {("mooncake_worker_engine_waiting_requests", ()): 0}
    assert families["mooncake_worker_kv_cache_usage_ratio"][1] == {("mooncake_worker_kv_cache_usage_ratio", ()): 0.5}
    assert families["mooncake_worker_prefill_tokens"] == ("counter", {("mooncake_worker_prefill_tokens_total", ()): 100})
    assert families["mooncake_worker_decode_tokens"][1] == {("mooncake_worker_decode_tokens_total", ()): 5}
    cached = families["mooncake_worker_cached_prompt_tokens"][1]
    assert cached == {("mooncake_worker_cached_prompt_tokens_total", (("source", "local_cache_hit"),)): 32,
                      ("mooncake_worker_cached_prompt_tokens_total", (("source", "external_kv_transfer"),)): 256}


def test_waiting_counts_deferred_requests_too():
    metrics = WorkerMetrics()
    engine_stat_logger(metrics)(None, 0).record(scheduler_stats(0, 2, 3, 0.0), None)
    assert metrics.registry.get_sample_value("mooncake_worker_engine_waiting_requests") == 5


def test_transport_stats_buckets_are_cumulative_and_a_bound_is_inclusive():
    stats = TransportStats(buckets=(0.01, 0.1))
    for seconds in (0.005, 0.01, 0.05, 3.0):
        stats.request(seconds)
    stats.moved(sent=10, received=4)
    snap = stats.snapshot()
    assert snap["sent_bytes"] == 10 and snap["received_bytes"] == 4
    assert snap["request_seconds"] == {"le": [0.01, 0.1], "cumulative": [2, 3], "count": 4, "sum": pytest.approx(3.065)}


def test_a_real_engine_write_is_counted_on_both_sides_and_rendered():
    import numpy as np

    from messenger.api import Slice
    from messenger.engine import EngineConfig, TransferEngine

    config = EngineConfig(transports=("tcp",))
    sender, receiver = TransferEngine("s", config), TransferEngine("r", config)
    src, dst = np.arange(16384, dtype=np.uint8), np.zeros(16384, dtype=np.uint8)
    sender.register("src", src)
    receiver.register("dst", dst)
    try:
        sender.start()
        sender.add_peer(receiver.start())
        for _ in range(2):
            sender.write("r", [Slice("src", 0, "dst", 0, 16384)], b"note").wait(5)
        # A frame's bytes are counted by the thread that sent it once its send returns, which
        # may be after the peer's acknowledgement has completed the write.
        deadline = time.monotonic() + 5
        while True:
            sent, received = sender.stats()["tcp"], receiver.stats()["tcp"]
            if min(sent["sent_bytes"], received["received_bytes"]) >= 2 * 16384 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    finally:
        sender.close()
        receiver.close()
    assert (dst == src).all()
    assert sent["sent_bytes"] >= 2 * 16384 and received["received_bytes"] >= 2 * 16384
    assert sent["request_seconds"]["count"] == 2 and received["request_seconds"]["count"] == 0  # timed by the caller

    families = parse(WorkerMetrics().render(LOAD, {}, {"tcp": sent}).decode())
    kind, moved = families["mooncake_messenger_bytes"]
    assert kind == "counter"
    assert moved[("mooncake_messenger_bytes_total", (("direction", "sent"), ("transport", "tcp")))] == sent["sent_bytes"]
    kind, latency = families["mooncake_messenger_request_seconds"]
    assert kind == "histogram"
    assert latency[("mooncake_messenger_request_seconds_count", (("transport", "tcp"),))] == 2
    assert latency[("mooncake_messenger_request_seconds_bucket", (("le", "+Inf"), ("transport", "tcp")))] == 2
    assert latency[("mooncake_messenger_request_seconds_bucket", (("le", "5.0"), ("transport", "tcp")))] == 2


def test_no_messenger_snapshot_no_messenger_families():
    families = parse(WorkerMetrics().render(LOAD, {}).decode())
    assert not [name for name in families if name.startswith("mooncake_messenger_")]
