import msgspec
import pytest

from conductor.metrics import ConductorMetrics
from messenger.wire import WireError, decode_prefix, encode_prefix
from mooncake.protocol import (CHUNK_DECODER, ENCODER, REQUEST_DECODER, BadTransferParams, GenerateChunk,
                               PullParams, PushParams, encode_chunk_line, parse_pull, parse_push)
from mooncake.launcher import plan_cpu_binding
from mooncake.logs import QuietPollingFilter
from mooncake.protocol import GenerateRequest, Sampling


@pytest.mark.parametrize("cores,count,expected", [
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2, 3], 2, ["0-1", "2-3"]),
    ([0, 1, 2], 2, ["0-1", "2"]),
    ([0, 1], 3, ["0", "1", "0"]),
    ([0], 1, ["0"]),
    ([0, 2, 4, 6], 2, ["0,2", "4,6"]),  # a cpuset with holes: never a range over cores not ours
    ([0, 1, 8, 9], 1, ["0-1,8-9"]),
    ([2, 3, 34, 35, 36], 2, ["2-3,34", "35-36"]),
])
def test_cpu_binding_plan(cores, count, expected):
    assert plan_cpu_binding(cores, count) == expected


def test_params_round_trip_with_the_wire_keys():
    push = PushParams("t", "10.0.0.2:7000", 123, skip_blocks=1)
    pull = PullParams("t", 123, 9.0)
    assert push.to_params() == {"mooncake_push": {"transfer_id": "t", "dest": "10.0.0.2:7000", "num_tokens": 123,
                                                  "skip_blocks": 1}}
    assert pull.to_params() == {"mooncake_pull": {"transfer_id": "t", "num_tokens": 123, "wait_timeout_s": 9.0}}
    assert parse_push(push.to_params()) == push and parse_pull(pull.to_params()) == pull
    assert parse_push(None) is None and parse_pull({}) is None
    # As vLLM hands them to the connector: plain dicts, wait_timeout_s optional, ints for floats.
    assert parse_pull({"mooncake_pull": {"transfer_id": "t", "num_tokens": 5}}) == PullParams("t", 5, 30.0)
    assert parse_pull({"mooncake_pull": {"transfer_id": "t", "num_tokens": 5, "wait_timeout_s": 2}}).wait_timeout_s == 2.0
    assert parse_push({"mooncake_push": {"transfer_id": "t", "dest": "h:1", "num_tokens": 5}}).skip_blocks == 0


@pytest.mark.parametrize("params, match", [
    ({"mooncake_push": {"transfer_id": "t", "num_tokens": 1}}, r"missing required field `dest`"),
    ({"mooncake_push": {"transfer_id": "t", "dest": "h:1", "num_tokens": "1"}}, r"\$\.num_tokens"),
    ({"mooncake_push": "t"}, r"mooncake_push.*Expected `object`"),
])
def test_malformed_push_params_raise_a_clear_error(params, match):
    with pytest.raises(BadTransferParams, match=match):
        parse_push(params)


def test_malformed_pull_params_raise_a_clear_error():
    with pytest.raises(BadTransferParams, match=r"mooncake_pull.*\$\.num_tokens"):
        parse_pull({"mooncake_pull": {"transfer_id": "t", "num_tokens": [1]}})


def test_generate_request_round_trips_through_json_with_the_same_shape():
    import json

    req = GenerateRequest("r1", [1, 2, 3], Sampling(max_tokens=4, stop_token_ids=(7,), logit_bias=((5, -2.5), (9, 1.0))),
                          PullParams("t", 3).to_params())
    raw = ENCODER.encode(req)
    assert REQUEST_DECODER.decode(raw) == req
    body = json.loads(raw)
    assert set(body) == {"request_id", "prompt_token_ids", "sampling", "kv_transfer_params"}
    assert body["sampling"]["stop_token_ids"] == [7] and body["sampling"]["logit_bias"] == [[5, -2.5], [9, 1.0]]
    assert body["kv_transfer_params"] == {"mooncake_pull": {"transfer_id": "t", "num_tokens": 3, "wait_timeout_s": 30.0}}
    # kv_transfer_params stays a dict: vLLM passes it to the connector as one.
    assert isinstance(REQUEST_DECODER.decode(raw).kv_transfer_params, dict)
    # Optional parts may be left out by a sender.
    minimal = REQUEST_DECODER.decode(b'{"request_id":"r","prompt_token_ids":[1],"sampling":{"max_tokens":2}}')
    assert minimal.kv_transfer_params == {} and minimal.sampling == Sampling(max_tokens=2)


@pytest.mark.parametrize("body, match", [
    (b'{"request_id":"r","prompt_token_ids":[1,"x"],"sampling":{"max_tokens":2}}', r"\$\.prompt_token_ids\[1\]"),
    (b'{"request_id":"r","prompt_token_ids":[1],"sampling":{}}', r"missing required field `max_tokens` - at `\$\.sampling`"),
    (b'{"request_id":"r","prompt_token_ids":[1]}', r"missing required field `sampling`"),
    (b'{"request_id":"r","prompt_token_ids":[1],"sampling":{"max_tokens":2},"kv_transfer_params":[]}', r"\$\.kv_transfer_params"),
    (b"not json", r"malformed"),
])
def test_malformed_generate_requests_name_the_field(body, match):
    with pytest.raises(msgspec.DecodeError, match=match):
        REQUEST_DECODER.decode(body)


def test_chunk_lines_omit_none_fields_and_decode_back():
    line = encode_chunk_line(GenerateChunk([4, 5]))
    assert line == b'{"token_ids":[4,5]}\n'
    last = GenerateChunk([], finish_reason="stop", num_cached_tokens=16)
    assert encode_chunk_line(last) == b'{"token_ids":[],"finish_reason":"stop","num_cached_tokens":16}\n'
    assert CHUNK_DECODER.decode(encode_chunk_line(last)) == last
    assert CHUNK_DECODER.decode(b'{"token_ids":[],"error":"boom"}') == GenerateChunk([], error="boom")
    with pytest.raises(msgspec.ValidationError, match="missing required field `token_ids`"):
        CHUNK_DECODER.decode(b'{"error":"boom"}')
    with pytest.raises(msgspec.ValidationError, match=r"\$\.token_ids"):
        CHUNK_DECODER.decode(b'{"token_ids":"abc"}')


def test_access_log_leaves_out_polling_routes_only():
    import logging

    def access(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "GET", path, "1.1", 200), None)

    quiet = QuietPollingFilter()
    assert not quiet.filter(access("/internal/registry/instances/p0/load"))
    assert not quiet.filter(access("/health"))
    assert quiet.filter(access("/v1/completions"))


def test_wire_rejects_foreign_and_oversized_frames():
    with pytest.raises(WireError):
        decode_prefix(b"HTTP" + encode_prefix(b"{}", 0)[4:])
    with pytest.raises(WireError):
        decode_prefix(encode_prefix(b"{}", 1 << 40))


def test_metrics_text_declares_each_family_once():
    from conductor.metrics import LiveState

    metrics = ConductorMetrics()
    metrics.requests.labels(endpoint="completions", status="200", slo_class="default").inc()
    metrics.routes.labels(kind="colocated").inc()
    metrics.ttft.labels(slo_class="default").observe(0.3)
    metrics.watch(lambda: LiveState(in_flight=2, ready_workers={"prefill": 2, "decode": 1},
                                    push_bandwidth_Bps={"prefill-0": 1.5e9}))
    text = metrics.render().decode()
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)), helps
    assert 'mooncake_ready_workers{role="decode"} 1.0' in text and 'mooncake_ready_workers{role="prefill"} 2.0' in text
    assert 'mooncake_kv_push_bandwidth_bytes_per_second{instance="prefill-0"} 1.5e+09' in text
    assert "mooncake_in_flight_requests 2.0" in text
    assert 'mooncake_requests_total{endpoint="completions",slo_class="default",status="200"} 1.0' in text
    assert 'mooncake_routes_total{kind="colocated"} 1.0' in text
    assert 'mooncake_time_to_first_token_seconds_bucket{le="0.5",slo_class="default"} 1.0' in text
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])  # every sample ends in a number


@pytest.mark.parametrize("argv", [["serve"], ["prefill"], ["decode"], ["conductor"], ["sim"], ["profile"]])
def test_help_of_every_command_shows_defaults_but_never_none(argv, capsys):
    from mooncake.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "(default: " in text and "(default: None)" not in text and "(default: False)" not in text


def test_request_schema_sets_unknown_fields_aside_and_names_unsupported_ones():
    from conductor.schemas import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(model="m", prompt="a", some_future_field=1, best_of=1, logprobs=0,
                             response_format={"type": "text"}, tool_choice="none")
    assert body.unknown_fields() == ["some_future_field"] and body.unsupported_option() is None
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    assert chat.unsupported_option()[0] == "tools"
    # tool_choice "none": the tools only go into the chat template's prompt (vLLM's behaviour).
    tools_off = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                      tools=[{"type": "function"}], tool_choice="none")
    assert tools_off.unsupported_option() is None
    assert CompletionRequest(model="m", prompt="a", tools=[{"type": "function"}],
                             tool_choice="none").unsupported_option()[0] == "tools"  # no template to take them


def test_push_bandwidth_is_averaged_over_intervals_that_moved_enough_bytes():
    from conductor.bandwidth import PushBandwidthMeter

    m = PushBandwidthMeter(min_bytes=1000, weight=0.5)
    assert m.update(0, 0.0) is None  # nothing pushed yet
    assert m.update(500, 0.5) is None  # too few bytes to judge: the interval keeps growing
    assert m.update(2000, 1.0) == 2000.0  # 2000 bytes in 1 s
    assert m.update(6000, 2.0) == 0.5 * 2000.0 + 0.5 * 4000.0
    assert m.update(6000, 2.0) == 3000.0  # no new pushes: unchanged
    assert m.update(100, 0.05) == 3000.0  # counters reset (worker restarted): re-based, kept
    assert m.update(2100, 1.05) == 0.5 * 3000.0 + 0.5 * 2000.0
    late = PushBandwidthMeter(min_bytes=1000)
    assert late.update(10_000, 2.0) == 5000.0  # joined a worker that already pushed: its lifetime mean


def _worker_app(monkeypatch, seen: list):
    """The worker's real HTTP app with its engine replaced: run_request yields two chunks."""
    import mooncake.engine.app as worker_app
    from mooncake.control import ControlEndpoint
    from mooncake.engine.config import WorkerConfig

    async def fake_run_request(engine, request, overlap=None):
        seen.append(request)
        yield GenerateChunk([11], num_cached_tokens=0)
        yield GenerateChunk([12], finish_reason="length")

    monkeypatch.setattr(worker_app, "run_request", fake_run_request)
    app = worker_app.create_app(WorkerConfig(role="both", model="m", served_model_name="m"), 1, 2,
                                ControlEndpoint("/nonexistent/connector.sock", "00" * 16))
    app.state.worker.engine = object()  # "ready"; the lifespan (which builds vLLM) never runs
    return app


def test_worker_answers_400_naming_the_field_of_a_malformed_generate_body(monkeypatch):
    import asyncio

    import httpx

    async def main():
        app = _worker_app(monkeypatch, [])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            bad = {"request_id": "r", "prompt_token_ids": [1, "x"], "sampling": {"max_tokens": 2}}
            resp = await c.post("/internal/generate", json=bad)
            assert resp.status_code == 400 and "$.prompt_token_ids[1]" in resp.json()["error"]["message"]
            resp = await c.post("/internal/generate", content=b"{")
            assert resp.status_code == 400 and "truncated" in resp.json()["error"]["message"]
            resp = await c.post("/internal/abort", json={"request": "r"})
            assert resp.status_code == 400 and "request_id" in resp.json()["error"]["message"]
            resp = await c.post("/internal/kv_drop", json={"transfer_id": 5})
            assert resp.status_code == 400 and "$.transfer_id" in resp.json()["error"]["message"]
    asyncio.run(main())


def test_conductor_and_worker_speak_the_same_typed_ndjson(monkeypatch):
    import asyncio

    import httpx

    from conductor.workers import WorkerClient, WorkerHandle

    async def main():
        seen: list = []
        app = _worker_app(monkeypatch, seen)
        client = WorkerClient(token_timeout_s=5.0)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        req = GenerateRequest("r1", [1, 2], Sampling(max_tokens=2, logit_bias=((3, 1.5),)),
                              PushParams("t", "h:1", 2).to_params())
        chunks = [c async for c in client.generate(WorkerHandle(http_url="http://w"), req)]
        assert seen == [req]  # the worker decoded exactly what the conductor encoded
        assert chunks[0] == GenerateChunk([11], num_cached_tokens=0)
        # The request pushed KV, and no connector answers here: the last line says the KV did not land.
        assert chunks[1].token_ids == [12] and chunks[1].finish_reason == "length"
        assert "push_outcome" in chunks[1].kv_error
        await client.close()
    asyncio.run(main())


@pytest.mark.parametrize("line", [b'{"token_ids":"x"}', b'{"token_ids":[1]', b'[]'])
def test_a_malformed_worker_line_is_a_worker_error(line):
    import asyncio

    import httpx

    from conductor.workers import WorkerClient, WorkerError, WorkerHandle

    async def main():
        client = WorkerClient(token_timeout_s=5.0)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=b'{"token_ids":[1]}\n' + line + b"\n")))
        got = []
        with pytest.raises(WorkerError, match="failed: DecodeError|ValidationError") as err:
            async for chunk in client.generate(WorkerHandle(http_url="http://w"),
                                               GenerateRequest("r", [1], Sampling(max_tokens=2))):
                got.append(chunk)
        assert got == [GenerateChunk([1])] and err.value.started
        await client.close()
    asyncio.run(main())


def test_a_worker_whose_engine_dies_stops_and_a_failed_registration_is_said():
    """The running engine's death stops the worker (its runner exits non-zero and is restarted);
    a registration that failed for good shows on /health, not nowhere."""
    import asyncio
    from types import SimpleNamespace

    from mooncake.engine.app import _exit_when_engine_dies, _registration_ended

    async def main():
        engine = SimpleNamespace(errored=False)
        stopped = []
        state = SimpleNamespace(engine=engine, engine_died=False, on_engine_death=lambda: stopped.append(1),
                                config=SimpleNamespace(role="decode", instance_id="d0", registry_url="etcd://h:1"),
                                engine_error=None)
        watch = asyncio.create_task(_exit_when_engine_dies(state, poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not watch.done() and not stopped
        engine.errored = True
        await asyncio.wait_for(watch, 1)
        assert state.engine_died and stopped == [1]

        async def fails():
            raise ValueError("keepalive too slow")

        task = asyncio.create_task(fails())
        await asyncio.gather(task, return_exceptions=True)
        _registration_ended(state, task)
        assert "registration failed: ValueError: keepalive too slow" == state.engine_error

    asyncio.run(main())
