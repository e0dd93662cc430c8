"""The connector's data path without vLLM: a KVSender and a KVReceiver, each on its own transfer
engine, over real loopback.

A producer holds paged caches filled with known values and pushes a request's blocks layer by
layer, in chunks, as vLLM's steps would; the consumer lands them into *different* block ids of its
own caches. Every byte must arrive where the scheduler asked, blocks the consumer holds must not
travel, and corruption, a dead peer or a bad layout must turn into a reported failure.
"""

import sys
import time

import pytest
import torch

from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadSpec
from decode.staging import StagingConfig
from kv_connector.fault import flip_bytes_on_the_wire
from messenger.engine import EngineConfig, TransferEngine
from mooncake.kv_layout import runs as block_runs
from prefill.kv_sender import KVSender
from prefill.push_planner import SaveSpec

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 80, 4, 2, 8


def caches(fill: bool, seed: int = 7, dim: int = DIM) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        shape = (BLOCKS, 2, BLOCK, HEADS, dim)
        out[f"model.layers.{i}.attn"] = torch.rand(shape, generator=gen) if fill else torch.zeros(shape)
    return out


ENGINE = EngineConfig(transports=("tcp",), timeout_s=2.0)


@pytest.fixture(params=[("tcp",), ("shm", "tcp")], ids=["tcp", "shm"], autouse=True)
def transports(request, monkeypatch):
    """Every test here runs over each transport that runs on one host: tcp, and shm (same host)."""
    monkeypatch.setattr(sys.modules[__name__], "ENGINE", EngineConfig(transports=request.param, timeout_s=2.0))
    return request.param[0]


def make_consumer(dst, **staging):
    engine = TransferEngine("consumer", ENGINE)
    consumer = KVReceiver(engine, BLOCK, StagingConfig(**{"capacity_bytes": 64 << 20, **staging}))
    consumer.register_kv_caches(dst)
    engine.start(on_notify=consumer.on_notify, on_call=consumer.on_call)
    return engine, consumer


def make_producer(src, fault_flip=0):
    engine = TransferEngine("producer", ENGINE)
    producer = KVSender(engine, timeout_s=2.0)
    producer.register_kv_caches(src)
    engine.start()
    flip_bytes_on_the_wire(engine, fault_flip)
    return engine, producer


@pytest.fixture
def pair():
    src, dst = caches(True), caches(False)
    (p_engine, producer), (c_engine, consumer) = make_producer(src), make_consumer(dst)
    yield producer, consumer, src, dst, c_engine.info().transports["tcp"]
    producer.shutdown()
    p_engine.close()
    c_engine.close()


def spec(req, dest, ids, first, total, final, skip=0):
    return SaveSpec(req, "t-" + req, dest, tuple(ids), first, skip, total, num_tokens=total * BLOCK - 1, final=final)


def save(producer, src, specs):
    """One engine step: every layer's save, then wait_for_save (which must not wait)."""
    for name, tensor in src.items():
        producer.save_kv_layer(specs, name, tensor)
    start = time.monotonic()
    producer.wait_for_save()
    # It must not wait for its sends at all. The bound leaves room for a loaded machine's
    # scheduling; a wait for a send that times out (the dead-peer tests) would pass it.
    assert time.monotonic() - start < min(1.0, ENGINE.timeout_s / 2)


def wait_freed(producer, req_id, timeout=None):
    """vLLM's view: the request is finished; its blocks are freed once every send of it ended
    (acknowledged, failed or timed out: within the engine's timeout)."""
    deadline = time.monotonic() + (timeout or ENGINE.timeout_s + 3.0)
    while req_id not in producer.finished_sending({req_id}):
        assert time.monotonic() < deadline, f"{req_id}'s blocks were never freed"
        time.sleep(0.01)


def wait_loaded(consumer, req_id, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished, failed = consumer.collect_loads(set())
        if req_id in finished:
            return failed
        time.sleep(0.01)
    raise AssertionError("load never finished")


def test_adjacent_blocks_become_one_slice():
    assert block_runs((5, 6, 7, 2, 9, 10)) == [(0, 5, 3), (3, 2, 1), (4, 9, 2)]
    assert block_runs(()) == []


def test_chunks_land_exactly_where_the_consumer_allocated(pair, transports):
    producer, consumer, src, dst, dest = pair
    save(producer, src, [spec("p1", dest, (5, 6), 0, 4, final=False)])  # first chunk: blocks 0-1
    save(producer, src, [spec("p1", dest, (2, 9), 2, 4, final=True)])  # last chunk: blocks 2-3
    assert producer.outcome("t-p1", 5.0) == "ok"
    consumer.start_load_kv([LoadSpec("d1", "t-p1", block_ids=(0, 7, 3, 40), first_block=0, num_tokens=15,
                                     wait_timeout_s=5)])
    assert wait_loaded(consumer, "d1") == set()
    for name in src:
        for s, d in ((5, 0), (6, 7), (2, 3), (9, 40)):
            assert torch.equal(dst[name][d], src[name][s])
        assert dst[name][1].abs().sum() == 0  # untouched blocks stay untouched
    assert producer.finished_sending(set()) == set()  # vLLM has not finished the request yet
    assert producer.finished_sending({"p1"}) == {"p1"}  # now its blocks may be freed
    assert consumer.stats()["received_blocks"] == 4 * LAYERS
    assert producer._engine.stats()[transports]["sent_bytes"] > 0  # the transport under test moved them
    timeline = producer.timeline()[-1]
    assert timeline["transfer_id"] == "t-p1" and timeline["chunks"] == 2 and len(timeline["layers"]) == LAYERS
    assert all(0 < computed <= landed for computed, landed in timeline["layers"])


def test_blocks_the_consumer_holds_are_not_sent(pair):
    producer, consumer, src, dst, dest = pair
    save(producer, src, [spec("p", dest, (3, 4), 2, 4, final=True, skip=2)])
    assert producer.outcome("t-p", 5.0) == "ok"
    assert producer.stats()["pushed_blocks"] == 2 * LAYERS
    # The consumer's own prefix cache covers blocks 0-1 (even 0-2): it loads the rest only.
    consumer.start_load_kv([LoadSpec("d", "t-p", block_ids=(11,), first_block=3, num_tokens=15, wait_timeout_s=5)])
    assert wait_loaded(consumer, "d") == set()
    for name in src:
        assert torch.equal(dst[name][11], src[name][4])
    stats = consumer.stats()
    assert stats["received_blocks"] == 2 * LAYERS and stats["loaded_blocks"] == LAYERS


def test_a_consumer_that_lost_the_skipped_blocks_fails_the_load(pair):
    producer, consumer, src, dst, dest = pair
    save(producer, src, [spec("p", dest, (3, 4), 2, 4, final=True, skip=2)])
    assert producer.outcome("t-p", 5.0) == "ok"
    consumer.start_load_kv([LoadSpec("d", "t-p", block_ids=(10, 11, 12), first_block=1, num_tokens=15,
                                     wait_timeout_s=5)])
    assert wait_loaded(consumer, "d") == {"d"}  # vLLM recomputes: slower, never wrong
    assert all(t.abs().sum() == 0 for t in dst.values())


def test_32_concurrent_transfers_interleave_without_mixing():
    sources = [caches(True, seed=i) for i in range(2)]
    src = {name: torch.cat([s[name][:40] for s in sources]) for name in sources[0]}  # two "prompts" per half
    dst = caches(False)
    (p_engine, producer), (c_engine, consumer) = make_producer(src), make_consumer(dst)
    dest = c_engine.info().transports["tcp"]
    try:
        # 32 requests of 2 blocks each, in two chunks: every layer's save carries all of them.
        specs = [[spec(f"r{i}", dest, (2 * i,), 0, 2, final=False) for i in range(32)],
                 [spec(f"r{i}", dest, (2 * i + 1,), 1, 2, final=True) for i in range(32)]]
        for step in specs:
            save(producer, src, step)
        assert all(producer.outcome(f"t-r{i}", 10.0) == "ok" for i in range(32))
        # The consumer lands request i into blocks (79 - 2i, 78 - 2i): reversed, so a mix-up shows.
        consumer.start_load_kv([LoadSpec(f"d{i}", f"t-r{i}", (79 - 2 * i, 78 - 2 * i), 0, 7, 5) for i in range(32)])
        finished, failed, deadline = set(), set(), time.monotonic() + 10
        while len(finished) < 32 and time.monotonic() < deadline:
            done, bad = consumer.collect_loads(set())
            finished, failed = finished | done, failed | bad
        assert finished == {f"d{i}" for i in range(32)} and failed == set()
        for name in src:
            for i in range(32):
                assert torch.equal(dst[name][79 - 2 * i], src[name][2 * i])
                assert torch.equal(dst[name][78 - 2 * i], src[name][2 * i + 1])
        assert producer.finished_sending({f"r{i}" for i in range(32)}) == {f"r{i}" for i in range(32)}
    finally:
        producer.shutdown()
        p_engine.close()
        c_engine.close()


def test_a_flipped_byte_fails_the_load_and_the_push():
    src, dst = caches(True), caches(False)
    (p_engine, producer), (c_engine, consumer) = make_producer(src, fault_flip=1), make_consumer(dst)
    dest = c_engine.info().transports["tcp"]
    try:
        save(producer, src, [spec("p", dest, (0, 1), 0, 2, final=True)])
        assert "checksum" in producer.outcome("t-p", 5.0).lower()
        consumer.start_load_kv([LoadSpec("d", "t-p", (4, 5), 0, 7, 5)])
        assert wait_loaded(consumer, "d") == {"d"}
        assert consumer.stats()["checksum_failures"] == 1
        assert all(t.abs().sum() == 0 for t in dst.values())
        assert producer.stats()["push_failures"] == 1
    finally:
        producer.shutdown()
        p_engine.close()
        c_engine.close()


def test_missing_kv_times_out_into_a_failure_not_a_hang(pair):
    _, consumer, _, _, _ = pair
    consumer.start_load_kv([LoadSpec("d", "never", block_ids=(0,), first_block=0, num_tokens=4, wait_timeout_s=0.5)])
    assert consumer.collect_loads(set()) == (set(), set())  # still waiting
    deadline = time.monotonic() + 5
    while (done := consumer.collect_loads(set())) == (set(), set()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done == ({"d"}, {"d"})


def test_a_dead_peer_fails_the_push_within_the_timeout_and_frees_the_blocks(pair):
    producer, _, src, _, _ = pair
    start = time.monotonic()
    save(producer, src, [spec("p", "127.0.0.1:1", (0,), 0, 1, final=True)])
    outcome = producer.outcome("t-p", 10.0)
    assert outcome != "ok" and time.monotonic() - start < 5.0
    wait_freed(producer, "p")
    assert producer.stats()["push_failures"] == 1


def test_a_frozen_decode_worker_holds_up_only_its_own_pushes(pair):
    """A decode worker that accepts connections but never answers (frozen: SIGSTOP, a stalled
    host): a push to a healthy one queued after it still lands at once, not after the timeout."""
    import socket
    producer, consumer, src, dst, dest = pair
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # connections complete in the backlog; nothing reads them
    try:
        save(producer, src, [spec("f", f"127.0.0.1:{frozen.getsockname()[1]}", (0,), 0, 1, final=True)])
        save(producer, src, [spec("g", dest, (1, 2), 0, 2, final=True)])
        assert producer.outcome("t-g", 10.0) == "ok"
        assert producer.outcome("t-f", 0) is None  # the frozen one is still waiting for its answer
        consumer.start_load_kv([LoadSpec("g", "t-g", block_ids=(5, 6), first_block=0, num_tokens=2 * BLOCK - 1,
                                         wait_timeout_s=5)])
        assert wait_loaded(consumer, "g") == set()
        for name in src:
            assert torch.equal(dst[name][[5, 6]], src[name][[1, 2]])
        assert producer.outcome("t-f", 10.0) not in (None, "ok")  # and fails within the timeout
        wait_freed(producer, "f")
    finally:
        frozen.close()


def test_an_idle_decode_workers_sender_thread_ends_and_a_later_push_starts_another(pair, monkeypatch):
    import threading
    import prefill.kv_sender as kv_sender
    monkeypatch.setattr(kv_sender, "LANE_IDLE_S", 0.2)
    producer, _, src, _, dest = pair
    for n in range(2):
        save(producer, src, [spec(f"i{n}", dest, (n,), 0, 1, final=True)])
        assert producer.outcome(f"t-i{n}", 10.0) == "ok"
        deadline = time.monotonic() + 5
        while any(t.name == f"kv-push-{dest}" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the idle sender thread never ended"
            time.sleep(0.02)
        assert producer._lanes == {}


def test_an_unknown_transfer_is_reported_not_waited_for(pair):
    producer = pair[0]
    start = time.monotonic()
    assert "no KV push" in producer.outcome("nobody", 5.0)
    assert time.monotonic() - start < 0.5


def test_an_incompatible_layout_is_refused_before_any_byte_moves():
    src = caches(True)
    (p_engine, producer), (c_engine, consumer) = make_producer(src), make_consumer(caches(False, dim=DIM * 2))
    try:
        save(producer, src, [spec("p", c_engine.info().transports["tcp"], (0,), 0, 1, final=True)])
        assert "layout" in producer.outcome("t-p", 5.0)
        assert consumer.stats()["staged_bytes"] == 0
    finally:
        producer.shutdown()
        p_engine.close()
        c_engine.close()


def _consumer_process(conn, transports) -> None:
    """A decode worker's receiver in its own process (killed by the test below)."""
    global ENGINE
    ENGINE = EngineConfig(transports=transports, timeout_s=2.0)
    engine, consumer = make_consumer(caches(False))
    conn.send(engine.info().transports["tcp"])
    while True:
        consumer.collect_loads(set())
        time.sleep(0.05)


def test_a_peer_killed_mid_transfer_fails_the_push_within_the_timeout():
    import multiprocessing
    import os
    import signal

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    peer = context.Process(target=_consumer_process, args=(there, ENGINE.transports), daemon=True)
    peer.start()
    src = caches(True)
    p_engine, producer = make_producer(src)
    try:
        assert here.poll(60), "the consumer process did not start"
        dest = here.recv()
        save(producer, src, [spec("p", dest, (0, 1), 0, 4, final=False)])  # the first chunk lands
        deadline = time.monotonic() + 10
        while producer.stats()["pushed_blocks"] < 2 * LAYERS:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert producer._engine.stats()[ENGINE.transports[0]]["sent_bytes"] > 0
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        start = time.monotonic()
        save(producer, src, [spec("p", dest, (2, 3), 2, 4, final=True)])
        outcome = producer.outcome("t-p", 30.0)
        assert outcome is not None and outcome != "ok"
        # The engine's timeout bounds it (plus scheduling slack on a loaded 2-core machine).
        assert time.monotonic() - start < ENGINE.timeout_s + 3.0, outcome
        wait_freed(producer, "p")  # and the blocks are freed
    finally:
        producer.shutdown()
        p_engine.close()
        if peer.is_alive():
            peer.kill()


def test_a_restarted_decode_worker_is_reached_again():
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    first = context.Process(target=_consumer_process, args=(there, ENGINE.transports), daemon=True)
    first.start()
    src = caches(True)
    p_engine, producer = make_producer(src)
    restarted = None
    try:
        assert here.poll(60), "the consumer process did not start"
        dest = here.recv()
        save(producer, src, [spec("a", dest, (0,), 0, 1, final=True)])
        assert producer.outcome("t-a", 5.0) == "ok"
        first.kill()  # the decode worker dies; a new one comes up at the same address
        first.join(10)
        config = EngineConfig(transports=ENGINE.transports, timeout_s=2.0, port=int(dest.rsplit(":", 1)[1]))
        restarted = TransferEngine("consumer-2", config)
        consumer = KVReceiver(restarted, BLOCK, StagingConfig(capacity_bytes=16 << 20))
        consumer.register_kv_caches(caches(False))
        restarted.start(on_notify=consumer.on_notify, on_call=consumer.on_call)
        outcomes = []
        for name in ("b", "c"):  # the first may still go to the engine that is gone; the next must not
            save(producer, src, [spec(name, dest, (1,), 0, 1, final=True)])
            outcomes.append(producer.outcome("t-" + name, 10.0))
        assert outcomes[-1] == "ok", outcomes
    finally:
        producer.shutdown()
        p_engine.close()
        if restarted is not None:
            restarted.close()
        if first.is_alive():
            first.kill()


def test_a_preempted_requests_sends_settle_before_its_blocks_are_reused(pair):
    producer, consumer, src, dst, dest = pair
    save(producer, src, [spec("p", dest, tuple(range(8)), 0, 16, final=False)])
    producer.settle({"p"})  # returns once nothing reads blocks 0-7 any more
    assert producer.stats()["pushed_blocks"] == 8 * LAYERS
    save(producer, src, [spec("q", "127.0.0.1:1", (9,), 0, 2, final=False)])  # a peer that never answers
    start = time.monotonic()
    producer.settle({"q"})
    assert time.monotonic() - start < ENGINE.timeout_s + 2
    assert producer.outcome("t-q", 5.0) != "ok"
