"""The worker's /metrics (mooncake/engine/metrics.py and its route), parsed back with
prometheus_client's own parser. No engine: the app's lifespan (which builds vLLM) never runs."""

import asyncio

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import mooncake.engine.app as worker_app
from mooncake.control import ControlEndpoint, ControlServer
from mooncake.engine.app import WorkerState, _stream, create_app
from mooncake.engine.config import WorkerConfig
from mooncake.engine.metrics import _KV_COUNTERS, WorkerMetrics
from mooncake.protocol import GenerateChunk, GenerateRequest, Sampling

LOAD = {"running_requests": 2, "queued_prefill_tokens": 40}


def parse(text: str) -> dict:
    """family name -> (type, {(sample name, sorted labels): value})."""
    return {f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
            for f in text_string_to_metric_families(text)}


def test_names_types_values_and_total_suffixes():
    m = WorkerMetrics()
    m.requests.labels(outcome="ok").inc()
    m.requests.labels(outcome="ok").inc()
    m.requests.labels(outcome="error").inc()
    m.prompt_tokens.inc(17)
    m.generated_tokens.inc(5)
    m.first_token.observe(0.07)
    m.first_token.observe(3.0)
    kv = {"pushed_bytes": 4096, "push_seconds": 0.25, "loaded_tokens": 32}
    families = parse(m.render(LOAD, kv).decode())

    kind, samples = families["mooncake_worker_requests"]
    assert kind == "counter"
    assert samples[("mooncake_worker_requests_total", (("outcome", "ok"),))] == 2
    assert samples[("mooncake_worker_requests_total", (("outcome", "error"),))] == 1
    assert families["mooncake_worker_prompt_tokens"][1][("mooncake_worker_prompt_tokens_total", ())] == 17
    assert families["mooncake_worker_generated_tokens"][1][("mooncake_worker_generated_tokens_total", ())] == 5

    kind, samples = families["mooncake_worker_first_token_seconds"]
    assert kind == "histogram"
    name = "mooncake_worker_first_token_seconds"
    buckets = {dict(labels)["le"]: v for (n, labels), v in samples.items() if n == name + "_bucket"}
    assert list(buckets) == ["0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf"]
    assert buckets["0.05"] == 0 and buckets["0.1"] == 1 and buckets["2.5"] == 1 and buckets["5.0"] == 2
    assert samples[(name + "_count", ())] == 2 and samples[(name + "_sum", ())] == pytest.approx(3.07)

    assert families["mooncake_worker_running_requests"] == ("gauge", {("mooncake_worker_running_requests", ()): 2})
    assert families["mooncake_worker_queued_prefill_tokens"] == (
        "gauge", {("mooncake_worker_queued_prefill_tokens", ()): 40})

    # Connector counters: exposed under their `_total` names, only the fields reported.
    assert families["mooncake_kv_pushed_bytes"] == ("counter", {("mooncake_kv_pushed_bytes_total", ()): 4096})
    assert families["mooncake_kv_push_seconds"] == ("counter", {("mooncake_kv_push_seconds_total", ()): 0.25})
    assert families["mooncake_kv_loaded_tokens"] == ("counter", {("mooncake_kv_loaded_tokens_total", ()): 32})
    assert "mooncake_kv_load_timeouts" not in families


def test_help_text_is_kept():
    text = WorkerMetrics().render(LOAD, {"checksum_failures": 0}).decode()
    assert "# HELP mooncake_worker_requests_total Requests finished by this worker, by outcome." in text
    assert "# HELP mooncake_worker_queued_prefill_tokens Prompt tokens not yet prefilled (tokens)." in text
    assert "# HELP mooncake_kv_checksum_failures_total Layers refused for a bad checksum." in text
    assert "# TYPE mooncake_kv_checksum_failures_total counter" in text


def test_every_connector_counter_is_exposed_when_reported():
    kv = {key: i + 1 for i, key in enumerate(_KV_COUNTERS)}
    families = parse(WorkerMetrics().render(LOAD, kv).decode())
    for i, (name, _help) in enumerate(_KV_COUNTERS.values()):
        family = name.removesuffix("_total")
        assert families[family] == ("counter", {(name, ()): i + 1}), name


def test_a_label_with_quote_backslash_and_newline_round_trips():
    m = WorkerMetrics()
    odd = 'a"b\\c\nd'
    m.requests.labels(outcome=odd).inc(3)
    text = m.render(LOAD, {}).decode()
    assert 'outcome="a\\"b\\\\c\\nd"' in text  # escaped on the wire: one sample line, not two
    samples = parse(text)["mooncake_worker_requests"][1]
    assert samples[("mooncake_worker_requests_total", (("outcome", odd),))] == 3


def test_two_metrics_objects_share_nothing():
    a, b = WorkerMetrics(), WorkerMetrics()
    a.prompt_tokens.inc(100)
    a.requests.labels(outcome="ok").inc()
    families = parse(b.render(LOAD, {}).decode())
    assert families["mooncake_worker_prompt_tokens"][1][("mooncake_worker_prompt_tokens_total", ())] == 0
    assert families["mooncake_worker_requests"][1] == {}
    assert a.registry is not b.registry


def _app(endpoint: ControlEndpoint):
    config = WorkerConfig(role="decode", model="/nonexistent", served_model_name="m")
    # TestClient used without `with` does not run the lifespan, so no engine is built.
    return create_app(config, kv_port=0, events_port=0, control=endpoint)


def test_route_serves_connector_counters_from_the_control_channel():
    endpoint = ControlEndpoint.new()
    server = ControlServer(endpoint, lambda req: {"ok": True, "stats": {"loaded_bytes": 123456789}}).start()
    try:
        response = TestClient(_app(endpoint)).get("/metrics")
    finally:
        server.close()
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    families = parse(response.text)
    assert families["mooncake_kv_loaded_bytes"][1] == {("mooncake_kv_loaded_bytes_total", ()): 123456789}
    assert families["mooncake_worker_running_requests"][1] == {("mooncake_worker_running_requests", ()): 0}


def test_route_without_a_connector_still_answers_without_kv_counters():
    response = TestClient(_app(ControlEndpoint.new())).get("/metrics")  # nobody listens there
    assert response.status_code == 200
    families = parse(response.text)
    assert not [name for name in families if name.startswith("mooncake_kv_")]
    assert "mooncake_worker_requests" in families and "mooncake_worker_running_requests" in families


@pytest.mark.parametrize("fail,outcome", [(False, "ok"), (True, "error")])
def test_stream_records_tokens_first_token_and_outcome(monkeypatch, fail, outcome):
    async def fake_run_request(engine, gen, overlap=None):
        yield GenerateChunk([11, 12])
        yield GenerateChunk([13], finish_reason=None if fail else "stop")
        if fail:
            raise RuntimeError("engine broke")

    monkeypatch.setattr(worker_app, "run_request", fake_run_request)
    state = WorkerState(config=None, kv_port=0, events_port=0, control=None, engine=object())
    gen = GenerateRequest("r1", [1, 2, 3, 4], Sampling(max_tokens=3))

    async def drain():
        return [line async for line in _stream(state, gen)]

    lines = asyncio.run(drain())
    assert len(lines) == (3 if fail else 2)
    families = parse(state.metrics.render({"running_requests": 0, "queued_prefill_tokens": 0}, {}).decode())
    assert families["mooncake_worker_requests"][1] == {("mooncake_worker_requests_total", (("outcome", outcome),)): 1}
    assert families["mooncake_worker_prompt_tokens"][1][("mooncake_worker_prompt_tokens_total", ())] == 4
    assert families["mooncake_worker_generated_tokens"][1][("mooncake_worker_generated_tokens_total", ())] == 3
    ttft = families["mooncake_worker_first_token_seconds"][1]
    assert ttft[("mooncake_worker_first_token_seconds_count", ())] == 1
    assert state.in_flight == {}


def test_no_created_timestamps_are_exposed():
    # prometheus_client adds a `_created` series beside each counter and histogram; no rule or
    # panel reads them, and the conductor leaves them out too (mooncake/prometheus_text.py).
    m = WorkerMetrics()
    m.requests.labels(outcome="ok").inc()
    text = m.render(LOAD, {key: 0 for key in _KV_COUNTERS}).decode()
    assert "mooncake_worker_requests_total" in text and "_created" not in text
