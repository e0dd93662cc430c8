"""The worker shell at its edges (no engine): a taken port said before anything is built, a
request id that is already running (also two at once), and a KV drop the connector did not hear of."""

from __future__ import annotations

import socket

import msgspec
from fastapi.testclient import TestClient

import mooncake.engine.runner as runner
from mooncake.control import ControlEndpoint
from mooncake.engine.app import InFlight, create_app
from mooncake.engine.config import WorkerConfig
from mooncake.protocol import GenerateRequest, Sampling


def test_a_worker_whose_port_is_taken_says_so_before_building_anything(monkeypatch, caplog):
    # uvicorn binds after the start-up, which builds the engine (a minute on CPU), for nothing.
    built = []
    monkeypatch.setattr(runner, "create_app", lambda *args, **kwargs: built.append(args))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = WorkerConfig(role="prefill", model="/nonexistent", served_model_name="m", port=port)
        assert runner.run_worker(config) == 3  # the supervisor reads 3 as "its port taken?"
    assert built == []
    assert f"cannot listen on 127.0.0.1:{port}" in caplog.text


def _app(endpoint: ControlEndpoint | None = None):
    config = WorkerConfig(role="decode", model="/nonexistent", served_model_name="m")
    return create_app(config, kv_port=0, events_port=0, control=endpoint or ControlEndpoint.new())


def test_a_request_id_already_running_is_refused_not_run_twice():
    app = _app()
    state = app.state.worker
    state.engine = object()  # ready (the request is refused before it would reach the engine)
    state.in_flight["r1"] = InFlight(prompt_tokens=3, started_at=0.0)
    body = msgspec.json.encode(GenerateRequest("r1", [1, 2, 3], Sampling(max_tokens=2)))
    response = TestClient(app).post("/internal/generate", content=body)
    assert response.status_code == 409 and response.json()["error"]["code"] == "duplicate_request"
    assert list(state.in_flight) == ["r1"]  # the running one's books are untouched


def test_a_kv_drop_the_connector_did_not_take_says_so():
    response = TestClient(_app()).post("/internal/kv_drop", content=b'{"transfer_id": "t1"}')  # nobody listens
    assert response.status_code == 200
    assert response.json()["ok"] is False and response.json()["error"]


def test_a_failure_without_a_message_is_still_reported_as_an_error(monkeypatch):
    # vLLM's EngineGenerateError has no text: the line must still carry an error, or the
    # conductor takes it for the engine's own finish "error" (a 500, never retried elsewhere).
    import asyncio

    import mooncake.engine.app as worker_app
    from mooncake.engine.app import WorkerState, _stream
    from mooncake.protocol import CHUNK_DECODER

    async def failing(engine, gen, overlap=None):
        yield worker_app.GenerateChunk([5])
        raise RuntimeError()

    monkeypatch.setattr(worker_app, "run_request", failing)
    state = WorkerState(config=None, kv_port=0, events_port=0, control=None, engine=object())

    async def lines():
        return [line async for line in _stream(state, GenerateRequest("r1", [1, 2], Sampling(max_tokens=3)))]

    last = CHUNK_DECODER.decode(asyncio.run(lines())[-1])
    assert last.finish_reason == "error" and last.error == "RuntimeError"


def test_two_requests_of_one_id_at_the_same_instant_do_not_share_the_books(monkeypatch):
    # Both pass generate's 409 check before either stream starts: the second stream must not take
    # over the first's entry (the first to end would erase the other's load and drain wait).
    import asyncio

    import mooncake.engine.app as worker_app
    from mooncake.engine.app import WorkerState, _stream
    from mooncake.protocol import CHUNK_DECODER

    async def slow(engine, gen, overlap=None):
        for token in (5, 6):
            await asyncio.sleep(0.01)
            yield worker_app.GenerateChunk([token], finish_reason="length" if token == 6 else None)

    monkeypatch.setattr(worker_app, "run_request", slow)
    state = WorkerState(config=None, kv_port=0, events_port=0, control=None, engine=object())

    async def main():
        first, second = (_stream(state, GenerateRequest("r1", [1, 2], Sampling(max_tokens=2))) for _ in range(2))
        got_first = [await first.__anext__()]
        entry = state.in_flight["r1"]
        got_second = [line async for line in second]
        assert state.in_flight.get("r1") is entry  # the running one's books are untouched
        got_first += [line async for line in first]
        return [CHUNK_DECODER.decode(x) for x in got_first], [CHUNK_DECODER.decode(x) for x in got_second]

    first, second = asyncio.run(main())
    assert [c.token_ids for c in first] == [[5], [6]] and first[-1].finish_reason == "length"
    assert len(second) == 1 and second[0].finish_reason == "error" and "already running" in second[0].error
    assert state.in_flight == {}
