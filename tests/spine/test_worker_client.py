"""The conductor's client of the workers (conductor/workers.py): health polling, and many
streams at once against a real HTTP server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from conductor.workers import WorkerClient, WorkerHandle
from mooncake.protocol import ENCODER, GenerateChunk, GenerateRequest, Sampling
from tests.http_server import served


def test_a_slow_health_answer_keeps_a_worker_routed_until_it_stays_slow_and_a_refusal_does_not():
    answers: list = []

    def reply(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"instance_id": "w", "role": "decode", "status": "ready"})

    async def main():
        client = WorkerClient(token_timeout_s=5.0, health_timeouts_tolerated=2)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(reply))
        handle = WorkerHandle(http_url="http://w")
        slow = httpx.ReadTimeout("no answer in 2 s")

        async def poll(*outcomes) -> list[bool]:
            answers.extend(outcomes)
            seen = []
            for _ in outcomes:
                await client.check(handle)
                seen.append(handle.ready)
            return seen

        assert await poll(slow) == [False]  # never seen ready: nothing to keep
        assert await poll(200, slow, slow, slow) == [True, True, True, False]  # the third in a row takes it out
        assert handle.status == "unreachable" and "ReadTimeout" in handle.last_error
        assert await poll(200, slow, 200, slow, slow) == [True] * 5  # an answer in between starts the count again
        assert await poll(httpx.ConnectError("refused")) == [False]  # a dead process leaves at once
        assert await poll(200, httpx.ConnectTimeout("no SYN-ACK")) == [True, False]  # as does a host that is gone
        assert await poll(200, 503) == [True, False]  # as does one that says it cannot serve
        await client.close()
    asyncio.run(main())


def slow_worker(release: threading.Event, streaming: list) -> FastAPI:
    """A worker whose /internal/generate sends one token, then the last once `release` is set."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"instance_id": "w", "role": "decode", "status": "ready"}

    @app.post("/internal/generate")
    async def generate():
        async def lines():
            streaming.append(1)
            yield ENCODER.encode(GenerateChunk([1])) + b"\n"
            while not release.is_set():
                await asyncio.sleep(0.02)
            yield ENCODER.encode(GenerateChunk([2], finish_reason="length")) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


@pytest.fixture
def worker():
    release, streaming = threading.Event(), []
    try:
        with served(slow_worker(release, streaming)) as url:
            yield url, release, streaming
    finally:
        release.set()  # before the server stops: its streams end


def test_more_streams_than_an_http_pool_holds_run_at_once_and_health_is_still_answered(worker):
    # httpx's default pool holds 100 connections: the 101st stream, and every health poll, would
    # wait for one until PoolTimeout. The conductor admits up to max_in_flight (256) requests.
    url, release, streaming = worker
    streams = 150

    async def one(client: WorkerClient, handle: WorkerHandle, i: int) -> list[GenerateChunk]:
        return [c async for c in client.generate(handle, GenerateRequest(f"r{i}", [1], Sampling(max_tokens=2)))]

    async def main():
        client = WorkerClient(token_timeout_s=30.0, connect_timeout_s=2.0, health_timeouts_tolerated=0)
        handle = WorkerHandle(http_url=url)
        tasks = [asyncio.create_task(one(client, handle, i)) for i in range(streams)]
        deadline = time.monotonic() + 30
        while len(streaming) < streams:  # every stream has its first token: all are open at once
            assert time.monotonic() < deadline, f"only {len(streaming)} of {streams} streams started"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()][:1]
            await asyncio.sleep(0.05)
        await client.check(handle)
        assert handle.ready and handle.last_error is None, handle.last_error
        release.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all([c.token_ids for c in chunks] == [[1], [2]] for chunks in results)
        await client.close()
    asyncio.run(main())
