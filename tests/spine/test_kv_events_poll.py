"""The conductor's long poll of a worker's KV events: the worker holds a poll until a block is
logged (or the hold ends), and the conductor follows each ready worker without ever polling one in
a tight loop. Real worker app over ASGI, real event log; no engine."""

import asyncio
import threading
import time

import httpx
from fastapi import FastAPI

from conductor.core.index import PrefixIndex
from conductor.membership import _follow_events
from conductor.workers import WorkerPool
from mooncake.engine.kv_events import BlockEventLog, LogChanges


def worker_app(tmp_path):
    from mooncake.control import ControlEndpoint
    from mooncake.engine.app import create_app
    from mooncake.engine.config import WorkerConfig

    config = WorkerConfig(role="decode", model="m", served_model_name="m")
    return create_app(config, 1, 2, ControlEndpoint(str(tmp_path / "none.sock"), "00" * 16))


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w", timeout=30)


def ready_worker(pool: WorkerPool, instance_id: str, url: str = "http://w"):
    """A handle the health poll has marked ready (none runs here)."""
    handle = pool.add(url)
    handle.instance_id, handle.ready = instance_id, True
    return handle


def store_later(log: BlockEventLog, hashes: list[int], delay_s: float) -> threading.Thread:
    """As the engine's subscriber thread does: log blocks from another thread."""
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), log.stored(hashes)))
    thread.start()
    return thread


def test_a_held_poll_answers_when_a_block_is_logged_and_at_the_end_of_its_hold(tmp_path):
    app = worker_app(tmp_path)
    log = app.state.worker.event_log

    async def run():
        async with client(app) as c:
            first = (await c.get("/internal/kv_events", params={"since": -1, "wait": 5})).json()
            assert first["reset"] is True  # a snapshot is news: answered at once
            seq = first["seq"]
            # Nothing new: held for the whole wait, then an empty page.
            started = time.monotonic()
            empty = (await c.get("/internal/kv_events", params={"since": seq, "wait": 0.4})).json()
            held = time.monotonic() - started
            assert 0.35 <= held < 3.0 and empty["stored"] == [] and not empty["reset"]
            # A block logged from another thread during a 10 s hold answers it at once.
            writer = store_later(log, [0xABC], 0.3)
            started = time.monotonic()
            page = (await c.get("/internal/kv_events", params={"since": seq, "wait": 10})).json()
            took = time.monotonic() - started
            writer.join()
            assert page["stored"] == ["abc"] and took < 3.0, (page, took)
            # A poll without `wait` (older conductors) is answered at once, as before.
            started = time.monotonic()
            await c.get("/internal/kv_events", params={"since": page["seq"]})
            assert time.monotonic() - started < 1.0

    asyncio.run(run())


def test_a_bad_or_huge_wait_is_bounded(tmp_path):
    app = worker_app(tmp_path)

    async def run():
        async with client(app) as c:
            seq = (await c.get("/internal/kv_events", params={"since": -1})).json()["seq"]
            started = time.monotonic()
            resp = await c.get("/internal/kv_events", params={"since": seq, "wait": "nan"})
            assert resp.status_code == 200 and time.monotonic() - started < 1.0
            resp = await c.get("/internal/kv_events", params={"since": seq, "wait": "soon"})
            assert resp.status_code == 400 and resp.json()["error"]["type"]
            started = time.monotonic()
            resp = await c.get("/internal/kv_events", params={"since": seq, "wait": -5})
            assert resp.status_code == 200 and time.monotonic() - started < 1.0

    asyncio.run(run())


def test_log_changes_wake_every_waiter_and_miss_no_change():
    async def run():
        log = BlockEventLog()
        changes = LogChanges(asyncio.get_running_loop())
        log.add_listener(changes.notify_threadsafe)
        waiters = [asyncio.create_task(changes.current().wait()) for _ in range(3)]
        await asyncio.to_thread(log.stored, [1])
        await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
        # A change between taking the event and awaiting it is not lost.
        event = changes.current()
        await asyncio.to_thread(log.removed, [1])
        await asyncio.wait_for(event.wait(), 2.0)
        # Storing what is already held changes nothing and wakes nobody.
        log.stored([2])
        await asyncio.sleep(0.05)
        quiet = changes.current()
        await asyncio.to_thread(log.stored, [2])
        await asyncio.sleep(0.1)
        assert not quiet.is_set()

    asyncio.run(run())


def test_the_conductor_follows_a_worker_into_its_index_at_once(tmp_path):
    app = worker_app(tmp_path)
    log = app.state.worker.event_log
    pool, index = WorkerPool(), PrefixIndex()
    handle = ready_worker(pool, "w")

    async def run():
        async with client(app) as http:
            follower = asyncio.create_task(_follow_events(http, pool, handle, index, 0.25, 10.0))
            await asyncio.sleep(0.3)  # the snapshot was taken; the next poll is held
            log.stored([0x5EED])
            deadline = time.monotonic() + 3.0
            while not index.holds("w", 0x5EED) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert index.holds("w", 0x5EED)
            pool.remove("http://w")  # the worker left: its follower ends with its current poll
            log.stored([0x5EEE])
            await asyncio.wait_for(follower, 3.0)

    asyncio.run(run())


def test_a_block_held_only_in_the_pool_reaches_the_index_with_its_tier(tmp_path):
    """The engine evicts a block the pool keeps: the conductor's index still has it, marked as a
    DRAM load (priced by the scheduler); loaded back into the engine, it is free again."""
    app = worker_app(tmp_path)
    log = app.state.worker.event_log
    pool, index = WorkerPool(), PrefixIndex()
    handle = ready_worker(pool, "w")

    async def until(check) -> None:
        deadline = time.monotonic() + 3.0
        while not check() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert check()

    async def run():
        async with client(app) as http:
            follower = asyncio.create_task(_follow_events(http, pool, handle, index, 0.25, 10.0))
            await asyncio.sleep(0.3)
            log.stored([0xA, 0xB])  # computed by the engine
            log.stored([0xA, 0xB], "dram")  # and saved by the pool
            await until(lambda: index.holds("w", 0xB))
            assert index.pool_only_blocks("w", [0xA, 0xB], 2) == {}
            log.removed([0xA, 0xB])  # the engine evicts both; the pool keeps them
            await until(lambda: index.pool_only_blocks("w", [0xA, 0xB], 2) == {"dram": 2})
            assert index.match([0xA, 0xB]) == {"w": 2}
            log.stored([0xA])  # a request loaded 0xA back into the engine
            await until(lambda: index.pool_only_blocks("w", [0xA, 0xB], 2) == {"dram": 1})
            pool.remove("http://w")
            log.stored([0xC])
            await asyncio.wait_for(follower, 3.0)

    asyncio.run(run())


def test_a_worker_that_answers_at_once_is_not_polled_in_a_tight_loop():
    polls = []
    old_worker = FastAPI()

    @old_worker.get("/internal/kv_events")
    async def kv_events(since: int = -1):  # ignores `wait`, as a worker before long polls did
        polls.append(time.monotonic())
        return {"seq": 7, "reset": since < 0, "block_size": 16, "stored": [], "removed": []}

    pool, index = WorkerPool(), PrefixIndex()
    handle = ready_worker(pool, "w")

    async def run():
        async with client(old_worker) as http:
            follower = asyncio.create_task(_follow_events(http, pool, handle, index, 0.2, 10.0))
            await asyncio.sleep(1.0)
            handle.ready = False
            await asyncio.wait_for(follower, 2.0)

    asyncio.run(run())
    # The snapshot, then one poll per 0.2 s at most: not hundreds.
    assert 3 <= len(polls) <= 8, len(polls)


def test_a_held_poll_ends_when_the_worker_starts_leaving(tmp_path):
    app = worker_app(tmp_path)

    async def run():
        async with client(app) as c:
            seq = (await c.get("/internal/kv_events", params={"since": -1})).json()["seq"]
            asyncio.get_running_loop().call_later(0.3, app.state.worker.drain.begin, time.monotonic())
            started = time.monotonic()
            resp = await c.get("/internal/kv_events", params={"since": seq, "wait": 20})
            assert resp.status_code == 200 and time.monotonic() - started < 2.5

    asyncio.run(run())


def test_a_page_held_across_the_workers_restart_is_dropped_for_a_snapshot(tmp_path):
    """The health poll saw the worker go down during a held poll and asked for a snapshot
    (events_seq -1): the page that comes back afterwards is the old process's and is not applied."""
    app = worker_app(tmp_path)
    log = app.state.worker.event_log
    pool, index = WorkerPool(), PrefixIndex()
    handle = ready_worker(pool, "w")

    async def run():
        async with client(app) as http:
            follower = asyncio.create_task(_follow_events(http, pool, handle, index, 0.25, 10.0))
            await asyncio.sleep(0.3)  # snapshot taken, next poll held
            handle.ready, handle.events_seq = False, -1  # what poll_health does when it goes down
            log.stored([0xDEAD])  # answers the held poll
            await asyncio.wait_for(follower, 3.0)
            assert handle.events_seq == -1 and not index.holds("w", 0xDEAD)

    asyncio.run(run())


def test_a_worker_added_again_under_its_url_is_followed_at_once():
    """Removed and added again (a new handle for the same URL): its follower starts at once, not
    when the old handle's held poll ends (10 s here)."""
    from conductor.membership import poll_kv_events

    log = BlockEventLog()
    log.stored([1])
    worker = FastAPI()

    @worker.get("/internal/kv_events")
    async def kv_events(since: int = -1, wait: float = 0.0):
        page = log.since(since)
        if not page.reset:
            await asyncio.sleep(wait)  # a held poll with no news
        return {"seq": page.seq, "reset": page.reset, "block_size": 16,
                "stored": [format(h, "x") for h in page.stored], "removed": []}

    pool, index = WorkerPool(), PrefixIndex()
    first = ready_worker(pool, "w-old")

    async def run():
        poller = asyncio.create_task(poll_kv_events(pool, index, 0.05, wait_s=10.0,
                                                    transport=httpx.ASGITransport(app=worker)))
        try:
            deadline = time.monotonic() + 3.0
            while first.events_seq < 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert first.events_seq >= 0  # its snapshot came; its next poll is held
            pool.remove("http://w")
            ready_worker(pool, "w-new")
            deadline = time.monotonic() + 3.0
            while not index.holds("w-new", 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert index.holds("w-new", 1)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    asyncio.run(run())
