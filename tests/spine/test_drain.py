"""Graceful drain on SIGTERM (mooncake/drain.py): the worker's and the conductor's drain on their
real HTTP apps (no engine, no lifespan), and the signal handling of DrainingServer in a real
uvicorn process. The drain on real engines and etcd is in tests/cluster/test_replicas.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

import mooncake.engine.app as worker_app
from conductor.app import create_app as create_conductor_app, drain_conductor
from conductor.config import ConductorConfig
from conductor.core.index import PrefixIndex
from conductor.workers import WorkerPool
from mooncake.control import ControlEndpoint
from mooncake.drain import wait_idle
from mooncake.engine.config import WorkerConfig
from mooncake.protocol import GenerateChunk
from mooncake.registry import ClusterView, InstanceInfo, MemoryRegistry, RegistryConfig, ViewConfig
from tests.processes import ROOT, free_port

GENERATE = {"request_id": "r1", "prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}


def test_wait_idle_ends_when_the_last_request_ends_or_when_the_grace_does():
    async def main():
        busy = [2]

        async def finish_later():
            await asyncio.sleep(0.15)
            busy[0] = 0

        started = time.monotonic()
        asyncio.ensure_future(finish_later())
        assert await wait_idle(lambda: busy[0], grace_s=5.0, poll_s=0.01) == 0
        assert 0.1 < time.monotonic() - started < 1.0
        busy[0] = 3
        started = time.monotonic()
        assert await wait_idle(lambda: busy[0], grace_s=0.2, poll_s=0.01) == 3  # gave up, said how many
        assert 0.15 < time.monotonic() - started < 1.0
    asyncio.run(main())


def _worker(monkeypatch, release: asyncio.Event, drain_timeout_s: float):
    async def held_run_request(engine, request, overlap=None):  # a request in flight until `release` is set
        yield GenerateChunk([11], num_cached_tokens=0)
        await release.wait()
        yield GenerateChunk([12], finish_reason="length")

    monkeypatch.setattr(worker_app, "run_request", held_run_request)
    config = WorkerConfig(role="prefill", model="m", served_model_name="m", instance_id="p1",
                          registry_url="memory://", drain_timeout_s=drain_timeout_s)
    app = worker_app.create_app(config, 1, 2, ControlEndpoint("/nonexistent/connector.sock", "00" * 16))
    app.state.worker.engine = object()  # "ready"; the lifespan (which builds vLLM) never runs
    return app


async def _registered(state) -> MemoryRegistry:
    registry = MemoryRegistry(RegistryConfig(url="memory://", ttl_s=5))
    await registry.register(InstanceInfo("p1", "prefill", "http://w", "w:1", "m", 128, 1024, 0.0), ttl_s=5)
    state.registry = registry
    return registry


def test_a_draining_worker_leaves_the_registry_refuses_new_work_and_finishes_what_it_has(monkeypatch):
    async def main():
        release = asyncio.Event()
        app = _worker(monkeypatch, release, drain_timeout_s=30)
        state = app.state.worker
        registry = await _registered(state)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            assert (await c.get("/health")).status_code == 200
            in_flight = asyncio.ensure_future(c.post("/internal/generate", json=GENERATE))
            while not state.in_flight:
                await asyncio.sleep(0.01)
            draining = asyncio.ensure_future(worker_app.drain_worker(state))
            await asyncio.sleep(0.1)
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = await c.post("/internal/generate", json={**GENERATE, "request_id": "r2"})
            assert refused.status_code == 503 and refused.json()["error"]["message"] == "worker is draining"
            assert "p1" not in await registry.snapshot()  # gone from every conductor's watch now
            assert not draining.done()  # still waiting for r1
            release.set()
            answer = await asyncio.wait_for(in_flight, 5)
            await asyncio.wait_for(draining, 5)
        assert answer.status_code == 200
        lines = answer.text.splitlines()
        assert len(lines) == 2 and '"finish_reason":"length"' in lines[-1]  # finished, not cut
        await registry.close()
    asyncio.run(main())


def test_a_worker_drain_gives_up_after_its_grace(monkeypatch):
    async def main():
        app = _worker(monkeypatch, asyncio.Event(), drain_timeout_s=0.3)
        state = app.state.worker
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            stuck = asyncio.ensure_future(c.post("/internal/generate", json=GENERATE))
            while not state.in_flight:
                await asyncio.sleep(0.01)
            started = time.monotonic()
            await asyncio.wait_for(worker_app.drain_worker(state), 5)
            assert 0.25 < time.monotonic() - started < 2.0
            assert state.in_flight  # left to uvicorn's shutdown, which cancels it
            stuck.cancel()
    asyncio.run(main())


def test_a_draining_conductor_says_503_draining_and_waits_for_its_requests():
    async def main():
        app = create_conductor_app(ConductorConfig(model_path="unused", served_model_name="m", drain_timeout_s=30))
        # What the lifespan would set; one request in flight.
        service = SimpleNamespace(in_flight=1, snapshot=lambda: {"in_flight": service.in_flight})
        app.state.service, app.state.pool, app.state.index = service, WorkerPool(), PrefixIndex()
        app.state.view = ClusterView(ViewConfig(expire_after_s=10))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://c") as c:
            draining = asyncio.ensure_future(drain_conductor(app))
            await asyncio.sleep(0.1)
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert not draining.done()
            service.in_flight = 0
            await asyncio.wait_for(draining, 5)
    asyncio.run(main())


SERVER = textwrap.dedent("""
    import asyncio, sys, time
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from mooncake.drain import Drain, DrainingServer, wait_idle

    app, drain, busy = FastAPI(), Drain(), [0]

    @app.get("/health")
    async def health():
        return JSONResponse({"draining": drain.active}, status_code=503 if drain.active else 200)

    @app.get("/busy")
    async def busy_now():
        return {"busy": busy[0]}

    @app.get("/slow")
    async def slow():
        busy[0] += 1
        try:
            await asyncio.sleep(float(sys.argv[2]))
            return {"done": True}
        finally:
            busy[0] -= 1

    async def on_drain():
        drain.begin(time.monotonic())
        await wait_idle(lambda: busy[0], 30)

    DrainingServer(uvicorn.Config(app, port=int(sys.argv[1]), log_level="warning", timeout_graceful_shutdown=0.5),
                   drain=on_drain).run()
""")


def _start_server(tmp_path, slow_s: float) -> tuple[subprocess.Popen, str]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(slow_s)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("test server did not start")


def _slow_in_background(url: str) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(httpx.get(url + "/slow", timeout=30)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while httpx.get(url + "/busy", timeout=2).json()["busy"] < 1:  # the request is in the handler now
        assert time.monotonic() < deadline, "the slow request never reached its handler"
        time.sleep(0.02)
    return thread, out


def test_sigterm_drains_a_real_uvicorn_server_before_it_exits(tmp_path):
    proc, url = _start_server(tmp_path, slow_s=4.0)
    try:
        thread, out = _slow_in_background(url)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(url + "/health", timeout=2)  # still listening, saying it is leaving
        assert health.status_code == 503 and health.json() == {"draining": True}
        assert proc.wait(timeout=15) == 0
        thread.join(5)
        assert out and out[0].status_code == 200 and out[0].json() == {"done": True}
    finally:
        proc.kill()


def test_a_second_sigterm_skips_the_drain(tmp_path):
    proc, url = _start_server(tmp_path, slow_s=60.0)
    try:
        _slow_in_background(url)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)  # uvicorn's own shutdown (0.5 s grace), not the 30 s drain
        assert time.monotonic() - started < 5
    finally:
        proc.kill()


def test_an_exit_without_a_drain_runs_on_exit_and_a_first_sigterm_does_not():
    """on_exit (a worker: mark itself leaving, so held polls end) runs for Ctrl-C and for a
    SIGTERM that comes while draining; the first SIGTERM only starts the drain."""
    import uvicorn

    from mooncake.drain import DrainingServer

    calls = []

    async def drain():
        await asyncio.sleep(0)

    async def run():
        server = DrainingServer(uvicorn.Config(lambda scope, receive, send: None), drain,
                                on_exit=lambda: calls.append("exit"))
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        assert calls == [] and not server.should_exit
        server.handle_exit(signal.SIGINT, None)
        assert calls == ["exit"] and server.should_exit
        await asyncio.sleep(0.05)  # let the drain task that the first SIGTERM started finish

    asyncio.run(run())


def test_without_a_drain_a_first_sigterm_is_the_ordinary_shutdown_and_runs_on_exit():
    """`mooncake serve` has no drain: SIGTERM shuts down as Ctrl-C does, ending answers in
    progress with an error first (on_exit = conductor.app.close_streams)."""
    import uvicorn

    from mooncake.drain import DrainingServer

    calls = []

    async def run():
        server = DrainingServer(uvicorn.Config(lambda scope, receive, send: None), drain=None,
                                on_exit=lambda: calls.append("exit"))
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        assert calls == ["exit"] and server.should_exit

    asyncio.run(run())


def test_a_conductor_whose_drain_grace_ends_closes_the_answers_still_running():
    async def main():
        app = create_conductor_app(ConductorConfig(model_path="unused", served_model_name="m",
                                                   drain_timeout_s=0.2))
        service = SimpleNamespace(in_flight=1, closing=False)
        app.state.service = service
        await asyncio.wait_for(drain_conductor(app), 5)
        assert service.closing  # each ends at its next token with a 503 error (serving.ServerClosing)
    asyncio.run(main())
