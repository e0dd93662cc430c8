from mooncake.hashing import hash_prompt_blocks
from mooncake.engine.kv_events import BlockEventLog, BlockHashTranslator

B = 4


def test_translated_hashes_equal_the_conductors_prompt_hashes():
    """The key agreement the cache-aware router depends on: what a worker reports stored is
    exactly what the conductor computes from the same prompt."""
    prompt = list(range(100, 118))  # 4 full blocks + 2 tokens
    t = BlockHashTranslator()
    ours = t.stored(["e0", "e1"], None, prompt[:8], B) + t.stored(["e2", "e3"], "e1", prompt[8:16], B)
    assert ours == hash_prompt_blocks(prompt, B)


def test_unknown_parent_is_skipped_not_guessed():
    t = BlockHashTranslator()
    assert t.stored(["e5"], "never-seen", [1, 2, 3, 4], B) == []


def test_removed_maps_back_and_forgets():
    t = BlockHashTranslator()
    [h] = t.stored(["e0"], None, [1, 2, 3, 4], B)
    assert t.removed(["e0", "zzz"]) == [h]
    assert t.removed(["e0"]) == []


def test_log_pages_and_resets():
    log = BlockEventLog(max_events=4)
    first = log.since(-1)
    assert first.reset and first.stored == []
    log.stored([1, 2])
    page = log.since(first.seq)
    assert not page.reset and page.stored == [1, 2]
    log.removed([1])
    page2 = log.since(page.seq)
    assert page2.removed == [1] and page2.stored == []
    log.stored([3, 4, 5])  # pushes old events out of the 4-event window
    stale = log.since(page.seq - 1)
    assert stale.reset and sorted(stale.stored) == [2, 3, 4, 5]
    ahead = log.since(10_000)  # a worker that restarted: its seq went backwards for us
    assert ahead.reset


def test_a_page_gives_each_block_as_it_is_now():
    """Stored, evicted and stored again between two reads: the reader must end up holding it (a
    page of raw events applied as stored-then-removed would drop it), and the reverse."""
    log = BlockEventLog()
    log.stored([1, 2])
    seq = log.since(-1).seq
    log.removed([1])
    log.stored([1])
    log.removed([2])
    page = log.since(seq)
    assert page.stored == [1] and page.removed == [2]


# --- The ZMQ wiring between vLLM's real publisher and the worker's subscriber (no engine) ---

import asyncio  # noqa: E402
import socket  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402
import uvicorn  # noqa: E402

from mooncake.engine import app as worker_app  # noqa: E402
from mooncake.engine.config import WorkerConfig  # noqa: E402
from mooncake.engine.kv_events import KVEventSubscriber, KVEventsUnavailable, publisher_endpoint  # noqa: E402


def _stored_batch(engine_hashes: list[int], tokens: list[int]):
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=engine_hashes, parent_block_hash=None, token_ids=tokens, block_size=B,
        lora_id=None, medium="CPU", lora_name=None)])


def _publish_until_held(publisher, batch, log: BlockEventLog, timeout_s: float = 15.0) -> None:
    # ZMQ drops what a PUB sends before its SUB's subscription has reached it, so keep publishing
    # (the same blocks: storing them again changes nothing) until they arrive.
    deadline = time.monotonic() + timeout_s
    while not len(log):
        assert time.monotonic() < deadline, "no KV event reached the subscriber"
        publisher.publish(batch)
        time.sleep(0.1)


def test_vllms_publisher_reaches_the_worker_subscriber():
    """With the endpoint a worker gives vLLM (a plain tcp address, which vLLM's publisher
    connects to), the blocks vLLM publishes arrive keyed as the conductor keys the prompt. A
    subscriber that connected as well (the old wiring) never receives anything, and this fails."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    prompt = list(range(100, 108))
    log = BlockEventLog()
    subscriber = KVEventSubscriber(log, BlockHashTranslator()).start()
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=publisher_endpoint(subscriber.port), topic="kv")
    try:
        _publish_until_held(publisher, _stored_batch([11, 12], prompt), log)
    finally:
        publisher.shutdown()
        subscriber.stop()
    assert log.since(-1).stored == sorted(hash_prompt_blocks(prompt, B))


def test_an_unreadable_message_resets_the_log_and_the_reader_lives_on():
    """A malformed message (wrong frame count, a payload that is not an event batch) loses what it
    said: the log is cleared so conductors resync, and later events still arrive."""
    import zmq
    from vllm.distributed.kv_events import ZmqEventPublisher

    prompt = list(range(200, 208))
    log = BlockEventLog()
    subscriber = KVEventSubscriber(log, BlockHashTranslator()).start()
    rogue = zmq.Context.instance().socket(zmq.PUB)
    rogue.connect(subscriber.endpoint)
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=subscriber.endpoint, topic="kv")
    try:
        _publish_until_held(publisher, _stored_batch([21, 22], prompt), log)
        deadline = time.monotonic() + 15
        while len(log):  # the garbage empties the log (and does not kill the reader)
            assert time.monotonic() < deadline, "the malformed messages never reset the log"
            rogue.send_multipart([b"kv", b"not a sequence number"])
            rogue.send_multipart([b"kv", (7).to_bytes(8, "big"), b"\xff not msgpack"])
            time.sleep(0.1)
        _publish_until_held(publisher, _stored_batch([23, 24], prompt), log)
    finally:
        rogue.close(linger=0)
        publisher.shutdown()
        subscriber.stop()
    assert log.since(-1).stored == sorted(hash_prompt_blocks(prompt, B))


def _taken_port() -> socket.socket:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_subscriber_that_cannot_bind_says_so():
    with _taken_port() as holder:
        port = holder.getsockname()[1]
        with pytest.raises(KVEventsUnavailable, match=f"tcp://127.0.0.1:{port}"):
            KVEventSubscriber(BlockEventLog(), BlockHashTranslator(), port=port)


def _worker_config() -> WorkerConfig:
    return WorkerConfig(role="decode", model="/nonexistent", served_model_name="m")


def test_worker_start_up_fails_when_it_cannot_listen_for_kv_events(monkeypatch):
    """Not a worker that says ready while no conductor will ever see its cache: uvicorn (as
    mooncake/engine/runner.py runs it) stops with its start-up failure code before any engine."""
    from mooncake.control import ControlEndpoint

    monkeypatch.setattr(worker_app, "build_engine", lambda *a, **k: pytest.fail("engine built anyway"))
    with _taken_port() as holder:
        app = worker_app.create_app(_worker_config(), 0, holder.getsockname()[1], ControlEndpoint.new())
        with socket.socket() as http:
            http.bind(("127.0.0.1", 0))
            http_port = http.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="critical"))
        with pytest.raises(SystemExit) as exit_:
            server.run()
    assert exit_.value.code != 0


class _Engine:  # stands in for AsyncLLM: this test is about the ports, not the engine
    errored = False

    def shutdown(self) -> None:
        pass


def test_worker_tells_vllm_the_port_its_subscriber_holds(monkeypatch):
    """The port handed to build_engine (which puts it in vLLM's KVEventsConfig) is the one the
    subscriber bound before the build; what vLLM's publisher sends there reaches /internal/kv_events;
    and shutting the worker down releases the port."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from mooncake.control import ControlEndpoint

    given: list[int] = []

    def build_engine(config, kv_port, events_port, control, stat_loggers=None):
        given.append(events_port)
        return _Engine()

    monkeypatch.setattr(worker_app, "build_engine", build_engine)
    monkeypatch.setattr(worker_app, "kv_capacity_tokens", lambda engine: (B, 1000))
    app = worker_app.create_app(_worker_config(), 0, 0, ControlEndpoint.new())
    state = app.state.worker
    prompt = list(range(200, 208))

    async def serve_once() -> None:
        async with app.router.lifespan_context(app):
            while state.engine is None:
                assert state.engine_error is None, state.engine_error
                await asyncio.sleep(0.05)
            publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=publisher_endpoint(given[0]), topic="kv")
            try:
                await asyncio.to_thread(_publish_until_held, publisher, _stored_batch([21, 22], prompt),
                                        state.event_log)
            finally:
                publisher.shutdown()

    asyncio.run(serve_once())
    assert given == [state.subscriber.port] and given[0] != 0
    assert state.event_log.since(-1).stored == sorted(hash_prompt_blocks(prompt, B))
    KVEventSubscriber(BlockEventLog(), BlockHashTranslator(), port=given[0]).stop()  # free again
