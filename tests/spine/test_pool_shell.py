"""The worker shell's side of the KVCache pool, without an engine: options, the launcher's
per-worker SSD directories, the KV event log that joins the pool's tiers, the pool's metrics and
the engine's connector configuration."""

from __future__ import annotations

import argparse

from prometheus_client.parser import text_string_to_metric_families

from mooncake import defaults
from mooncake.control import ControlEndpoint
from mooncake.engine.cli import add_worker_arguments, check_worker_args, pool_arguments, pool_settings, worker_config
from mooncake.engine.engine import kv_transfer_settings
from mooncake.engine.kv_events import BlockEventLog
from mooncake.engine.metrics import WorkerMetrics
from mooncake.launcher import worker_pool_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, 8100)
    return parser.parse_args(["--insecure-no-cluster-token", *argv])


def test_the_pool_is_on_by_default_and_off_with_no_pool(monkeypatch):
    monkeypatch.delenv("MOONCAKE_POOL_DRAM_GIB", raising=False)  # tests/conftest.py sets a small one
    on = pool_settings(parse())
    assert on["pool_dram_bytes"] == defaults.POOL_DRAM_BYTES and on["pool_policy"] == defaults.POOL_POLICY
    assert on["pool_ssd_dir"] is None
    assert pool_settings(parse("--no-pool"))["pool_dram_bytes"] == 0
    config = worker_config(parse("--pool-dram-gib", "0.5", "--pool-ssd-dir", "/x", "--pool-ssd-gib", "3"),
                           "prefill", "/model")
    assert (config.pool_dram_bytes, config.pool_ssd_dir, config.pool_ssd_bytes) == (1 << 29, "/x", 3 << 30)
    assert config.pool_map_peers and not worker_config(parse("--no-pool-map-peers"), "prefill", "/m").pool_map_peers


def test_negative_pool_sizes_are_refused_before_anything_starts():
    assert any("--pool-dram-gib" in e for e in check_worker_args(parse("--pool-dram-gib", "-1")))
    assert not any("pool" in e for e in check_worker_args(parse()))


def test_serve_gives_each_worker_its_own_ssd_directory():
    args = pool_arguments(parse("--pool-ssd-dir", "/data/pool", "--pool-dram-gib", "1"))
    a, b = worker_pool_args(args, "prefill-0"), worker_pool_args(args, "decode-1")
    assert a[a.index("--pool-ssd-dir") + 1] == "/data/pool/prefill-0"
    assert b[b.index("--pool-ssd-dir") + 1] == "/data/pool/decode-1"
    assert worker_pool_args(pool_arguments(parse("--no-pool")), "prefill-0") == ["--no-pool"]
    assert parse(*worker_pool_args(args, "p")).pool_dram_gib == 1.0  # the worker parses what serve passes
    # The SSD size goes with the directory, and only then (a worker refuses a size without one).
    assert parse(*worker_pool_args(pool_arguments(parse("--pool-ssd-dir", "/d", "--pool-ssd-gib", "3")), "p")).pool_ssd_gib == 3
    assert "--pool-ssd-gib" not in pool_arguments(parse("--pool-dram-gib", "1"))
    off = pool_arguments(parse("--no-pool-map-peers"))
    assert not parse(*worker_pool_args(off, "p")).pool_map_peers and parse(*worker_pool_args(args, "p")).pool_map_peers


def test_the_event_log_holds_a_block_while_any_tier_does():
    log = BlockEventLog()
    log.stored([1, 2])  # the engine computed them
    log.stored([1], "dram")  # and the pool saved one
    log.removed([1, 2])  # the engine evicted both
    page = log.since(0)
    # Each block as it is now: 1 is still held, by the pool only (a hit on it costs a DRAM load).
    assert page.stored == [1] and page.removed == [2] and page.pool_tiers == {1: "dram"}
    assert log.tier_blocks() == {"dram": 1}
    seq = page.seq
    log.stored([1], "ssd")  # a slower copy: nothing a reader sees changes
    assert log.since(seq).stored == [] and log.since(seq).seq == seq
    log.stored([1])  # loaded back into the engine: stored again, now free to reuse
    page = log.since(seq)
    assert page.stored == [1] and page.pool_tiers == {}
    log.removed([1])  # evicted from the engine again: the DRAM copy is the fastest left
    assert log.since(page.seq).pool_tiers == {1: "dram"}
    log.cleared("engine")  # the engine's events were lost: the pool's blocks stay
    snapshot = log.since(-1)
    assert snapshot.reset and snapshot.stored == [1] and snapshot.pool_tiers == {1: "dram"}
    log.removed([1], "dram")
    assert log.since(-1).pool_tiers == {1: "ssd"}
    log.removed([1], "ssd")
    assert len(log) == 0


def test_pool_metrics_have_units_and_tiers():
    stats = {"usage": {"dram": {"capacity_bytes": 100, "used_bytes": 40, "blocks": 2},
                       "ssd": {"capacity_bytes": 1000, "used_bytes": 0, "blocks": 0}},
             "counters": {"spills": 3, "corrupt": 1}}
    text = WorkerMetrics().render({"running_requests": 0, "queued_prefill_tokens": 0}, {}, {}, stats).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("mooncake_store_capacity_bytes", (("tier", "dram"),))] == 100
    assert samples[("mooncake_store_used_bytes", (("tier", "dram"),))] == 40
    assert samples[("mooncake_store_blocks", (("tier", "ssd"),))] == 0
    assert samples[("mooncake_store_events_total", (("kind", "corrupt"),))] == 1
    without = WorkerMetrics().render({"running_requests": 0, "queued_prefill_tokens": 0}, {}, {}, {}).decode()
    assert "mooncake_store_" not in without


def test_the_engine_runs_both_connectors_with_a_pool_and_ours_alone_without():
    config = worker_config(parse(), "prefill", "/model")
    control, pool = ControlEndpoint("/tmp/c.sock", "00" * 16), ControlEndpoint("/tmp/p.sock", "11" * 16)
    alone = kv_transfer_settings(config, 9000, control, None)
    assert alone["kv_connector"] == "MooncakeServeConnector" and alone["kv_load_failure_policy"] == "recompute"
    both = kv_transfer_settings(config, 9000, control, pool)
    assert both["kv_connector"] == "MultiConnector" and both["kv_load_failure_policy"] == "recompute"
    first, second = both["kv_connector_extra_config"]["connectors"]
    assert first["kv_connector"] == "MooncakeServeConnector"  # a pulled prompt is its own
    assert second["kv_connector"] == "MooncakePoolConnector"
    assert second["kv_connector_extra_config"] == {"pool_path": "/tmp/p.sock", "pool_key": "11" * 16}


def test_the_advertised_host_reaches_the_kv_connectors_messenger():
    control = ControlEndpoint("/tmp/c.sock", "00" * 16)
    wild = worker_config(parse("--host", "0.0.0.0", "--advertise-host", "10.9.8.7"), "decode", "/model")
    extra = kv_transfer_settings(wild, 9000, control, None)["kv_connector_extra_config"]
    assert (extra["kv_host"], extra["kv_advertise_host"]) == ("0.0.0.0", "10.9.8.7")
    plain = kv_transfer_settings(worker_config(parse(), "decode", "/model"), 9000, control, None)
    assert "kv_advertise_host" not in plain["kv_connector_extra_config"]


def test_the_pool_dram_default_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MOONCAKE_POOL_DRAM_GIB", "0.5")
    assert pool_settings(parse())["pool_dram_bytes"] == 1 << 29
    assert pool_settings(parse("--pool-dram-gib", "1"))["pool_dram_bytes"] == 1 << 30
