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

from conductor.workers import EngineFailed, StreamWatch, WorkerClient, WorkerError, WorkerHandle, WorkerPool
from mooncake.protocol import ENCODER, GenerateChunk, GenerateRequest, Sampling
from tests.http_server import served


async def mocked_client(handler, **options) -> WorkerClient:
    """A WorkerClient whose HTTP calls `handler` answers (httpx.MockTransport)."""
    client = WorkerClient(**{"token_timeout_s": 5.0, **options})
    await client._http.aclose()
    client._http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return client


def test_a_slow_health_answer_keeps_a_worker_routed_until_it_stays_slow_and_a_refusal_does_not():
    answers: list = []

    def reply(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"instance_id": "w", "role": "decode", "status": "ready"})

    async def main():
        client = await mocked_client(reply, health_timeouts_tolerated=2)
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


def test_health_names_a_static_worker_but_never_renames_a_registered_one():
    """A registered worker restarted on its URL answers /health with its new id before it
    registers, while the old one's lease runs: the registry's id stands (the view renames it to
    the newest instance), or the two would rename the handle back and forth."""
    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"instance_id": "w-new", "role": "decode", "status": "starting"})

    async def main():
        client = await mocked_client(reply)
        registered, static = WorkerHandle(http_url="http://r", instance_id="w-old"), WorkerHandle(http_url="http://s")
        static.static = True
        for handle in (registered, static):
            await client.check(handle)
        assert registered.name == "w-old" and static.name == "w-new"
        await client.close()
    asyncio.run(main())


def test_a_health_timeout_that_fired_late_is_the_conductors_delay_and_is_not_counted():
    def reply(request: httpx.Request) -> httpx.Response:
        time.sleep(1.4)  # holds the conductor's event loop, as an overloaded conductor would
        raise httpx.ReadTimeout("no answer")

    async def main():
        client = await mocked_client(reply, health_timeouts_tolerated=0, health_timeout_s=0.2)
        handle = WorkerHandle(http_url="http://w", ready=True, status="ready")
        await client.check(handle)
        assert handle.ready and handle.slow_health == 0  # tolerating none, it would be out
        await client.close()
    asyncio.run(main())


def test_a_worker_that_leaves_the_registry_mid_stream_is_polled_until_its_streams_end():
    # A frozen worker's lease expires before enough polls time out to give its streams up.
    pool = WorkerPool()
    quiet, streaming = pool.add("http://quiet"), pool.add("http://streaming/")
    streaming.streams.add(StreamWatch(now=0.0))
    streaming.ready = True
    pool.remove("http://quiet")
    pool.remove("http://streaming")
    assert pool.all() == [] and pool.ready("decode") == []  # neither is routed to
    assert pool.polled() == [streaming] and not streaming.ready and streaming.events_seq == -1
    assert pool.add("http://streaming") is streaming  # back in the registry: the same handle, streams and all
    pool.remove("http://streaming")
    streaming.streams.clear()
    assert pool.polled() == [] and pool.departed == {}
    assert pool.add("http://quiet") is not quiet


def slow_worker(release: threading.Event, streaming: list, frozen: threading.Event) -> FastAPI:
    """A worker whose /internal/generate sends one token (none for a prompt of [0]; a token every
    50 ms for [2]; not even its headers for [3]), then the last once `release` is set; its /health
    answers nothing while `frozen` is set, as a frozen process or a host gone would."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        while frozen.is_set():
            await asyncio.sleep(0.02)
        return {"instance_id": "w", "role": "decode", "status": "ready"}

    @app.post("/internal/generate")
    async def generate(body: dict):
        if body["prompt_token_ids"] == [3]:
            streaming.append(1)
            while not release.is_set():
                await asyncio.sleep(0.05)

        async def lines():
            if body["prompt_token_ids"] != [3]:
                streaming.append(1)
            if body["prompt_token_ids"] not in ([0], [3]):
                yield ENCODER.encode(GenerateChunk([1])) + b"\n"
            while not release.is_set():
                await asyncio.sleep(0.05)
                if body["prompt_token_ids"] == [2]:
                    yield ENCODER.encode(GenerateChunk([1])) + b"\n"
            yield ENCODER.encode(GenerateChunk([2], finish_reason="length")) + b"\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


@pytest.fixture
def worker():
    release, streaming, frozen = threading.Event(), [], threading.Event()
    try:
        with served(slow_worker(release, streaming, frozen)) as url:
            yield url, release, streaming, frozen
    finally:
        frozen.clear()
        release.set()  # before the server stops: its streams end


def test_a_worker_that_stops_answering_has_its_silent_streams_given_up_and_its_live_ones_kept(worker):
    # A frozen process or a host gone sends no reset: without this its streams wait token_timeout_s.
    url, release, streaming, frozen = worker

    async def read(client: WorkerClient, handle: WorkerHandle, prompt: int, task_per_line: bool):
        stream = client.generate(handle, GenerateRequest(f"r{prompt}{task_per_line}", [prompt], Sampling(max_tokens=9)))
        chunks = []
        while True:  # the conductor's merge of several streams reads each line in a task of its own
            line = asyncio.ensure_future(anext(stream, None)) if task_per_line else anext(stream, None)
            chunk = await line
            if chunk is None:
                return chunks
            chunks.append(chunk)

    async def main():
        given_up = []
        client = WorkerClient(token_timeout_s=60.0, health_timeouts_tolerated=1, health_timeout_s=0.3,
                              on_streams_given_up=lambda name, n: given_up.append((name, n)))
        handle = WorkerHandle(http_url=url)
        await client.check(handle)
        assert handle.ready
        # started; started, read with a task per line; no token; not even headers; live
        kinds = [(1, False), (1, True), (0, False), (3, False), (2, False)]
        tasks = [asyncio.create_task(read(client, handle, p, t)) for p, t in kinds]
        deadline = time.monotonic() + 10
        while len(streaming) < len(kinds):
            assert time.monotonic() < deadline and not any(t.done() for t in tasks)
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        frozen.set()
        await client.check(handle)  # tolerated: still routed, nothing given up
        assert handle.ready and handle.slow_health == 1 and not any(t.done() for t in tasks)
        await client.check(handle)
        assert not handle.ready and handle.status == "unreachable"
        done, _ = await asyncio.wait(tasks[:4], timeout=5)
        assert len(done) == 4, "the streams that went silent were not given up"
        for task, started in zip(tasks[:4], (True, True, False, False)):
            exc = task.exception()
            assert isinstance(exc, WorkerError) and "stopped answering" in str(exc), exc
            assert exc.started is started  # so the conductor retries elsewhere only a stream with no token yet
        assert not tasks[4].done()  # it is still sending: the worker is alive
        # Counted on /metrics (mooncake_worker_streams_given_up_total); the 0 after the first answered
        # poll makes the worker's series exist before its first give-up, which increase() needs.
        assert given_up == [("w", 0), ("w", 4)]
        frozen.clear()
        await client.check(handle)
        assert handle.ready and handle.slow_health == 0
        assert given_up[-1] == ("w", 0)
        release.set()
        chunks = await asyncio.wait_for(tasks[4], 10)
        assert chunks[-1].finish_reason == "length"
        assert handle.streams == set() and handle.in_flight == 0
        await client.close()
    asyncio.run(main())


def test_a_stream_given_up_while_its_reader_is_busy_fails_at_its_next_line_and_a_cancelled_caller_stays_cancelled(worker):
    url, release, streaming, frozen = worker

    async def main():
        client = WorkerClient(token_timeout_s=60.0, health_timeouts_tolerated=0, health_timeout_s=0.3)
        handle = WorkerHandle(http_url=url)
        stream = client.generate(handle, GenerateRequest("busy", [1], Sampling(max_tokens=9)))
        assert (await anext(stream)).token_ids == [1]
        (watch,) = handle.streams
        assert not watch.waiting  # the chunk is with its reader: abandoning must not cancel the reader
        frozen.set()
        await client.check(handle)
        with pytest.raises(WorkerError, match="stopped answering"):
            await anext(stream)

        # A caller cancelled at the same time as the poller gives its stream up stays cancelled.
        reader = asyncio.create_task(anext(client.generate(handle, GenerateRequest("both", [0], Sampling(max_tokens=9)))))
        while not any(w.waiting for w in handle.streams):
            await asyncio.sleep(0.02)
        (watch,) = handle.streams
        watch.abandon("gone")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        frozen.clear()
        await asyncio.sleep(0.3)  # the aborts sent to the worker, in tasks of their own, end
        await client.close()
    asyncio.run(main())


def test_more_streams_than_an_http_pool_holds_run_at_once_and_health_is_still_answered(worker):
    # httpx's default pool holds 100 connections: the 101st stream, and every health poll, would
    # wait for one until PoolTimeout. The conductor admits up to max_in_flight (256) requests.
    url, release, streaming, _ = worker
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


def _scripted_worker(lines: list[GenerateChunk], calls: list[str]):
    """A worker whose /internal/generate answers `lines` and records every call's path."""
    def reply(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/internal/generate":
            return httpx.Response(200, content=b"".join(ENCODER.encode(c) + b"\n" for c in lines))
        return httpx.Response(200, json={})
    return reply


def test_a_finished_stream_closed_at_its_last_chunk_sends_no_abort():
    """The relay stops reading at the finish chunk and closes the stream there: that sent an
    /internal/abort to the worker for every completed request."""
    async def main():
        calls: list[str] = []
        client = await mocked_client(_scripted_worker([GenerateChunk([7]), GenerateChunk([8], finish_reason="length")],
                                                      calls))
        handle = WorkerHandle(http_url="http://w")
        for stop_after in (2, 1):  # at the finish chunk; then one early (a stop string matched)
            stream = client.generate(handle, GenerateRequest(f"r{stop_after}", [1, 2], Sampling(max_tokens=2), {}))
            for _ in range(stop_after):
                await anext(stream)
            await stream.aclose()
            await asyncio.sleep(0.05)  # the abort is sent from a task of its own
        assert calls.count("/internal/abort") == 1
        await client.close()
    asyncio.run(main())


def test_an_engine_that_ends_a_request_with_an_error_is_an_error_not_a_finish():
    async def main():
        handle = WorkerHandle(http_url="http://w")
        for lines, started in (([GenerateChunk([7]), GenerateChunk([], finish_reason="error")], True),
                               ([GenerateChunk([], finish_reason="error")], False)):
            client = await mocked_client(_scripted_worker(lines, []))
            got = []
            with pytest.raises(EngineFailed, match="ended the request with an error") as info:
                async for chunk in client.generate(handle, GenerateRequest("r", [1, 2], Sampling(max_tokens=4), {})):
                    got.append(chunk)
            assert [c.token_ids for c in got] == [[7]] * started and info.value.started is started
            await client.close()
        # A worker's own failure carries an error, even one whose text is empty (vLLM's
        # EngineGenerateError has none): a worker failure, retried elsewhere, not the engine's finish.
        client = await mocked_client(_scripted_worker([GenerateChunk([], finish_reason="error", error="")], []))
        with pytest.raises(WorkerError) as info:
            async for _ in client.generate(handle, GenerateRequest("r", [1, 2], Sampling(max_tokens=4), {})):
                pass
        assert not isinstance(info.value, EngineFailed)
        await client.close()
    asyncio.run(main())


def test_a_worker_registered_at_an_url_httpx_cannot_parse_never_stops_the_health_poll():
    """A worker that advertised a bare IPv6 address registered http://fd00::7:8100: httpx's
    InvalidURL escaped check(), ended poll_health's gather, and with it the health of every
    worker (none joining later ever became ready). Workers now bracket IPv6 hosts."""
    from conductor.core.index import PrefixIndex
    from conductor.membership import poll_health
    from mooncake.engine.config import WorkerConfig

    def reply(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"instance_id": "good", "role": "decode", "status": "ready"})

    async def main():
        client = await mocked_client(reply)
        pool = WorkerPool()
        bad, good = pool.add("http://fd00::7:8100"), pool.add("http://good")
        await client.check(bad)  # refused like any unreachable worker, not raised
        assert not bad.ready and bad.status == "unreachable" and "InvalidURL" in bad.last_error

        async def broken(handle):  # whatever else a poll might raise
            if handle is bad:
                raise RuntimeError("boom")
            await WorkerClient.check(client, handle)

        client.check = broken
        task = asyncio.ensure_future(poll_health(pool, client, PrefixIndex(), 0.01))
        await asyncio.sleep(0.1)
        late = pool.add("http://late")  # joins after the failure
        await asyncio.sleep(0.1)
        assert not task.done() and good.ready and late.ready and not bad.ready and "boom" in bad.last_error
        task.cancel()
        await client.close()
    asyncio.run(main())
    v6 = WorkerConfig(role="decode", model="m", served_model_name="m", host="::", advertise_host="fd00::7", port=8100)
    assert v6.http_url == "http://[fd00::7]:8100" and httpx.URL(v6.http_url).host == "fd00::7"
