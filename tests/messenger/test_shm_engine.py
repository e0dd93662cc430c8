"""The shm transport under the real TransferEngine (messenger/engine.py), between two processes:
the engine picks it for a peer on this host, checksums ride along, notifications and calls work,
and a dead peer fails batches before the engine's timeout."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from messenger.api import ChecksumError, OutgoingMessage, Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from tests.messenger.shm_harness import EngineProcess, digest

SIZE = 4 << 20


@pytest.fixture(scope="module")
def peer():
    process = EngineProcess(size=SIZE, transports=("shm", "tcp"))
    yield process
    process.stop()


@pytest.fixture
def engine(peer):
    mem = np.zeros(SIZE, np.uint8)
    local = TransferEngine("local", EngineConfig(transports=("shm", "tcp"), call_lanes=False))
    local.register("mem", mem)
    info = local.start(on_call=lambda peer_name, request: b"local:" + request)
    assert local.add_peer(peer.info) == "shm"  # same host: shm, though tcp runs too
    assert peer("add_peer", msgspec.json.encode(info)) == "shm"
    yield local, mem
    local.close()


def test_a_checksummed_write_lands_before_on_notify(peer, engine):
    local, mem = engine
    mem[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    peer("fill", 2)
    slices = [Slice("mem", i * 65536, "mem", (63 - i) * 65536, 65536) for i in range(64)]
    local.write("peer", slices, b"all of it").wait(10)
    peer_name, message, error, seen = peer("notes")[-1]
    assert (peer_name, message, error) == ("local", b"all of it", None)
    expected = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    for s in slices:
        expected[s.remote_offset:s.remote_offset + s.length] = mem[s.local_offset:s.local_offset + s.length]
    assert seen == digest(expected)
    assert peer("digest", (0, SIZE)) == digest(expected)
    stats = local.stats()["shm"]
    assert stats["sent_bytes"] >= SIZE and stats["request_seconds"]["count"] >= 1


def test_a_read_and_a_call_through_the_engine(peer, engine):
    local, mem = engine
    peer("fill", 5)
    expected = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    local.read("peer", [Slice("mem", 0, "mem", 0, SIZE)]).wait(10)
    assert np.array_equal(mem, expected)
    assert local.call("peer", b"ping") == b"echo:ping"


def test_a_dead_peer_fails_a_batch_long_before_the_engine_timeout():
    process = EngineProcess(size=SIZE)
    local = TransferEngine("local", EngineConfig(transports=("shm",), timeout_s=30))
    local.register("mem", np.zeros(SIZE, np.uint8))
    local.start()
    try:
        local.add_peer(process.info)
        local.write("peer", [Slice("mem", 0, "mem", 0, 4096)], b"first").wait(10)
        process.kill()
        started = time.monotonic()
        with pytest.raises(TransferError, match="shm peer"):
            local.write("peer", [Slice("mem", 0, "mem", 0, 4096)], b"second").wait(30)
        assert time.monotonic() - started < 5
    finally:
        local.close()
        process.stop()


def shm_pair(config: EngineConfig = EngineConfig(transports=("shm",))):
    """Two engines in this process over shm (CMA with our own pid works as with another's)."""
    sender, receiver = TransferEngine("sender", config), TransferEngine("receiver", config)
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, np.uint8)
    sender.register("src", src)
    receiver.register("dst", dst)
    notes: list = []
    sender.start()
    info = receiver.start(on_notify=lambda peer, message, error: notes.append((peer, message, error)))
    assert sender.add_peer(info) == "shm"
    return sender, receiver, src, dst, notes


def test_32_concurrent_batches_over_shm_do_not_mix():
    sender, receiver, src, dst, notes = shm_pair()
    try:
        size = SIZE // 32
        part = size // 8
        errors: list = []

        def push(i: int) -> None:
            try:
                slices = [Slice("src", i * size + k * part, "dst", i * size + (7 - k) * part, part) for k in range(8)]
                sender.write("receiver", slices, i.to_bytes(2, "big")).wait(30)
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=push, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        for i in range(32):
            for k in range(8):
                got = dst[i * size + (7 - k) * part:i * size + (8 - k) * part]
                assert np.array_equal(got, src[i * size + k * part:i * size + (k + 1) * part]), (i, k)
        assert sorted(int.from_bytes(m, "big") for _, m, e in notes if e is None) == list(range(32))
    finally:
        sender.close()
        receiver.close()


def test_a_checksum_that_does_not_match_the_landed_bytes_fails_both_sides():
    """What a byte changed between the sender's hash and the copy looks like to the receiver:
    the Sums frame carries a checksum the landed bytes do not have."""
    sender, receiver, _, _, notes = shm_pair()
    transport = sender._peers["receiver"].transport
    real_submit = transport.submit

    def tampering_submit(peer, direction, slices, batch, message):
        good = message.checksums
        real_submit(peer, direction, slices, batch, OutgoingMessage(message.payload, (good[0] ^ 1, *good[1:])))

    transport.submit = tampering_submit
    try:
        batch = sender.write("receiver", [Slice("src", 0, "dst", 0, 1 << 20), Slice("src", 5, "dst", 7, 10)], b"n")
        with pytest.raises(ChecksumError, match="slice 0"):
            batch.wait(10)
        assert notes == [("sender", b"n", notes[0][2])] and "ChecksumError" in notes[0][2]
        transport.submit = real_submit
        sender.write("receiver", [Slice("src", 0, "dst", 0, 1 << 20)], b"fine").wait(10)
        assert notes[-1] == ("sender", b"fine", None)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("who_copies", ["initiator", "owner"])
def test_a_batch_that_timed_out_never_touches_memory_afterwards(monkeypatch, who_copies):
    """A slow owner (a GC pause, a loaded host): the initiator's read and write time out, and the
    caller reuses its buffers. Nothing lands in them afterwards, whichever side would have copied
    (this side by process_vm_readv after asking where; the owner into this side); the owner
    refuses the late write and tells its engine that it failed, not that it landed."""
    from messenger import shm_serve

    stall = threading.Event()
    answer, move = shm_serve.Served._answer, shm_serve.Served._move

    def slow(real):
        def run(self, request):
            if stall.is_set():
                time.sleep(1.0)
            return real(self, request)
        return run

    monkeypatch.setattr(shm_serve.Served, "_answer", slow(answer))
    monkeypatch.setattr(shm_serve.Served, "_move", slow(move))
    config = EngineConfig(transports=("shm",), timeout_s=0.3, call_lanes=False)
    a, b = TransferEngine("a", config), TransferEngine("b", config)
    notes = []
    theirs, mine = np.full(1 << 16, 0x42, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    outgoing, landing = np.full(1 << 16, 0x77, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
    a.register("mine", mine)
    a.register("outgoing", outgoing)
    b.register("theirs", theirs)
    b.register("landing", landing)
    try:
        a.start()
        a.add_peer(b.start(on_notify=lambda peer, message, error: notes.append((message, error))))
        b.add_peer(a.info())
        a.read("b", [Slice("mine", 0, "theirs", 0, 16)]).wait(5)  # connected, and knows where
        link = next(iter(a._transports["shm"]._links.values()))
        if who_copies == "owner":
            link.pull_pid = None  # the owner's process_vm_writev instead of this side's readv
            link.forget_where()
        elif link.pull_pid is None:
            pytest.skip("this host allows no cross-memory reads of a peer")
        else:
            link.forget_where()  # the read asks where again, and waits behind the stalled owner
        mine[:] = 0
        stall.set()
        with pytest.raises(TransferError, match="timed out"):
            a.read("b", [Slice("mine", 0, "theirs", 0, 1 << 16)]).wait(5)
        with pytest.raises(TransferError, match="timed out"):
            a.write("b", [Slice("outgoing", 0, "landing", 0, 1 << 16)], b"layer 7").wait(5)
        mine[:] = 0xAA  # the caller's buffer holds something else now
        time.sleep(2.5)  # the owner has woken up and answered both
        assert set(np.unique(mine)) == {0xAA}
        assert not landing.any()
        assert all(message == b"layer 7" and "timed out" in error for message, error in notes), notes
        if who_copies == "owner":  # the write went out in time, and was refused when it came up
            assert len(notes) == 1
        # (Behind the initiator's stalled read it never went out: the owner heard nothing.)
    finally:
        a.close()
        b.close()


def test_without_cma_a_write_never_lands_outside_the_region_it_names():
    """Without cross-memory attach, only the owner's region in a shared segment: this side copies
    into the owner's memory itself, before the owner checks. A slice past the region's end (its
    length as this side last heard it), or a region the owner moved since this side last asked
    where it lies, wrote into whatever the owner kept there (found by an audit of the messenger)."""
    from messenger.segments import SharedBuffer
    from messenger.shm import ShmConfig

    mib = 1 << 20
    config = EngineConfig(transports=("shm",), timeout_s=5)
    object.__setattr__(config, "shm", ShmConfig(use_cma=False))
    owner, writer = TransferEngine("owner", config), TransferEngine("writer", config)
    segment = SharedBuffer(2 * mib)
    src = np.full(mib, 0xAB, np.uint8)
    try:
        writer.register("src", src)
        owner.start()
        writer.start()
        owner.register("A", segment.array)
        assert writer.add_peer(owner.info()) == "shm"  # it hears of A as 2 MiB long
        owner.unregister("A")
        owner.register("A", segment.array[:mib])
        owner.register("B", segment.array[mib:])
        with pytest.raises(TransferError, match="outside"):
            writer.write("owner", [Slice("src", 0, "A", mib - 16, 4096)], b"past A").wait(10)
        assert not segment.array[mib:].any()  # B untouched

        writer.write("owner", [Slice("src", 0, "A", 0, 4096)], b"asks where A is").wait(10)
        segment.array[:] = 0
        owner.unregister("A")
        owner.unregister("B")
        owner.register("B", segment.array[:mib])  # A's old place is B's now
        owner.register("A", segment.array[mib:])
        writer.write("owner", [Slice("src", 0, "A", 0, 4096)], b"A moved").wait(10)
        assert not segment.array[:mib].any() and (segment.array[mib:mib + 4096] == 0xAB).all()
    finally:
        writer.close()
        owner.close()
        segment.close()
