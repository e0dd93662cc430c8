"""Every query in the Grafana dashboard and the Prometheus rules names only metrics that the
conductor and the workers export (or that a recording rule, or Prometheus itself, writes).

The exported names come from the real metric code, built in-process: the conductor's
ConductorMetrics with its scrape-time gauges, and a worker's WorkerMetrics rendered with every
connector counter and a messenger snapshot (what a worker whose connector answers serves).
tests/e2e/test_metrics_counts.py checks the same against a real cluster's scrapes."""

import json
import re

import pytest

from conductor.metrics import ConductorMetrics, LiveState
from messenger.stats import TransportStats
from mooncake.engine.metrics import _KV_COUNTERS, WorkerMetrics
from tests.deploy.promql import (DASHBOARD, PROMETHEUS_OWN, dashboard_queries, exported_labels, exported_names,
                                 label_problems, legend_labels, metric_names, recording_rule_names, result_labels,
                                 rules)


def conductor_text() -> str:
    metrics = ConductorMetrics()
    metrics.watch(lambda: LiveState(in_flight=1, ready_workers={"prefill": 1, "decode": 1},
                                    push_bandwidth_Bps={"p": 1e9}, retry_backlog_s={"prefill": 3.0}))
    return metrics.render().decode()


def worker_text() -> str:
    kv = {key: 1 for key in _KV_COUNTERS}
    # A pool's stats() as store/service.py gives them (one tier and one counter are enough to name
    # every family).
    pool = {"usage": {"dram": {"capacity_bytes": 1 << 30, "used_bytes": 0, "blocks": 0}}, "counters": {"spills": 0}}
    return WorkerMetrics().render({"running_requests": 0, "queued_prefill_tokens": 0}, kv,
                                  {"tcp": TransportStats().snapshot()}, pool).decode()


def known_labels() -> dict[str, frozenset[str]]:
    """Each exported series' label names (a conductor with one calibrated instance, so that the
    per-instance families have a child)."""
    from conductor.core import Estimators, load_profile
    from conductor.core.calibration import CalibrationConfig, InstanceCalibration

    calibration = InstanceCalibration(Estimators.from_profile(load_profile("smollm2-135m-cpu")), CalibrationConfig())
    conductor = ConductorMetrics()
    conductor.watch(lambda: LiveState(in_flight=1, ready_workers={"prefill": 1}, push_bandwidth_Bps={"p": 1e9},
                                      retry_backlog_s={"prefill": 3.0}, estimators={"p": calibration.describe()}))
    worker = WorkerMetrics()
    pool = {"usage": {"dram": {"capacity_bytes": 1 << 30, "used_bytes": 0, "blocks": 0}}, "counters": {"spills": 0}}
    worker_text = worker.render({"running_requests": 0, "queued_prefill_tokens": 0}, {key: 1 for key in _KV_COUNTERS},
                                {"tcp": TransportStats().snapshot()}, pool).decode()
    return {**exported_labels(conductor.render().decode(), [conductor]), **exported_labels(worker_text, [worker])}


def known_names() -> set[str]:
    return exported_names(conductor_text()) | exported_names(worker_text()) | recording_rule_names() | PROMETHEUS_OWN


def test_the_dashboard_has_the_panels_the_issue_asks_for():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    for wanted in ("SLO attainment by class", "Goodput", "TTFT percentiles", "TBT percentiles", "Refusals by reason",
                   "Prompt tokens by source", "Pool load: requests per instance", "Pool load: KV cache usage",
                   "KVCache pool: use by tier", "KVCache pool: events"):
        assert wanted in titles
    # Importable anywhere: every panel reads the datasource chosen in the dashboard's variable.
    assert [v["name"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]


@pytest.mark.parametrize("title,expr", dashboard_queries())
def test_every_dashboard_query_names_an_exported_metric(title, expr):
    names = metric_names(expr)
    assert names, f"{title}: {expr} selects no metric"
    assert names <= known_names(), f"{title}: not exported: {sorted(names - known_names())}"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("record") or r.get("alert"))
def test_every_rule_names_an_exported_metric(rule):
    names = metric_names(rule["expr"])
    assert names and names <= known_names(), sorted(names - known_names())


def dashboard_targets() -> list[tuple[str, str, str | None]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"], t.get("legendFormat")) for p in dashboard["panels"] for t in p.get("targets", [])]


@pytest.mark.parametrize("title,expr,legend", dashboard_targets())
def test_every_dashboard_query_reads_labels_its_series_carry(title, expr, legend):
    labels = known_labels()
    assert label_problems(expr, labels) == [], title
    carried = result_labels(expr, labels)
    assert carried is None or legend_labels(legend) <= carried, f"{title}: legend {legend!r} over {sorted(carried)}"


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r.get("record") or r.get("alert"))
def test_every_rule_reads_labels_its_series_carry(rule):
    labels = known_labels()
    assert label_problems(rule["expr"], labels) == []
    carried = result_labels(rule["expr"], labels)
    texts = " ".join(str(v) for v in (rule.get("annotations") or {}).values())
    named = set(re.findall(r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)", texts))
    assert carried is None or named <= carried, f"annotations name {sorted(named - carried)}"


@pytest.mark.parametrize("expr", [
    "sum by (tier) (rate(mooncake_store_events_total[5m]))",  # events are by kind
    "rate(mooncake_worker_engine_running_requests[5m])",  # a gauge
    "histogram_quantile(0.9, rate(mooncake_schedule_seconds_sum[5m]))",  # no buckets
    "histogram_quantile(0.9, sum by (slo_class) (rate(mooncake_time_to_first_token_seconds_bucket[5m])))",  # le lost
    'mooncake_worker_streams_given_up_total{worker="x"}',  # no such label
])
def test_the_label_checker_catches_what_a_name_check_lets_through(expr):
    assert label_problems(expr, known_labels())


def test_the_checker_catches_a_misspelled_metric():
    """A name off by one letter is not known: the test above can fail."""
    assert not metric_names("rate(mooncake_goodput_request_total[5m])") <= known_names()
    assert metric_names('sum(rate({__name__="mooncake_requests_total"}[$__rate_interval]))') == {"mooncake_requests_total"}


def test_new_conductor_and_worker_metrics_are_exported_with_their_units():
    conductor, worker = exported_names(conductor_text()), exported_names(worker_text())
    assert {"mooncake_goodput_requests_total", "mooncake_slo_requests_total", "mooncake_schedule_seconds_bucket",
            "mooncake_cached_prompt_tokens_total", "mooncake_prompt_tokens_total",
            "mooncake_ttft_prediction_ratio_bucket"} <= conductor
    assert {"mooncake_worker_engine_running_requests", "mooncake_worker_engine_waiting_requests",
            "mooncake_worker_kv_cache_usage_ratio", "mooncake_worker_prefill_tokens_total",
            "mooncake_worker_decode_tokens_total", "mooncake_worker_cached_prompt_tokens_total",
            "mooncake_messenger_bytes_total", "mooncake_messenger_request_seconds_bucket"} <= worker
