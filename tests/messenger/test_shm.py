"""The shm transport between this process and a real second one, by cross-memory attach (the
default here) and through shared-memory segments (forced, or because CMA is refused)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from messenger.api import Batch, ChecksumError, Direction, PeerInfo, Slice, TransferError
from messenger.segments import SharedBuffer
from messenger.shm import ShmConfig, ShmTransport
from tests.messenger.shm_harness import Inbox, PeerProcess, Table, digest, submit

SIZE = 1 << 20
NO_CMA = ShmConfig(use_cma=False)


def make_local(config: ShmConfig = ShmConfig(), shared: bool = False, size: int = SIZE):
    table = Table()
    segment = SharedBuffer(size) if shared else None
    mem = table.add("mem", segment.array if segment is not None else np.zeros(size, np.uint8))
    inbox = Inbox(table)
    transport = ShmTransport(shm=config, name="local")
    transport.start(table, inbox)
    return transport, mem, inbox, segment


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess(size=SIZE)
    yield process
    process.stop()


@pytest.fixture
def local():
    transport, mem, inbox, segment = make_local()
    yield transport, mem, inbox
    transport.close()
    if segment is not None:
        segment.close()


def scattered(count: int, length: int, seed: int, size: int = SIZE) -> list[Slice]:
    """`count` slices of `length` bytes at distinct random places on both sides."""
    rng = np.random.default_rng(seed)
    blocks = size // length
    here = rng.permutation(blocks)[:count]
    there = rng.permutation(blocks)[:count]
    return [Slice("mem", int(a) * length, "mem", int(b) * length, length) for a, b in zip(here, there)]


def test_write_lands_every_slice_before_the_notification(peer, local):
    transport, mem, _ = local
    mem[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    slices = scattered(64, 4096, seed=2)
    submit(transport, peer.info, Direction.WRITE, slices, b"layer 3", (11, 12)).wait(10)
    landed, _ = peer("inbox")
    name, got, message, checksums, seen = landed[-1]
    assert (name, message, checksums) == ("local", b"layer 3", (11, 12))
    assert got == slices
    # What the peer saw when notified is what we sent, and it is still there.
    assert seen == [digest(mem[s.local_offset:s.local_offset + s.length]) for s in slices]
    for s in slices[:8]:
        assert peer("digest", (s.remote_offset, s.length)) == digest(mem[s.local_offset:s.local_offset + s.length])


def test_read_copies_the_peers_bytes_here(peer, local):
    transport, mem, _ = local
    peer("fill", 7)
    expected = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    slices = scattered(32, 8192, seed=3)
    mem[:] = 0
    submit(transport, peer.info, Direction.READ, slices).wait(10)
    for s in slices:
        assert np.array_equal(mem[s.local_offset:s.local_offset + s.length],
                              expected[s.remote_offset:s.remote_offset + s.length])
    untouched = np.ones(SIZE, bool)
    for s in slices:
        untouched[s.local_offset:s.local_offset + s.length] = False
    assert not mem[untouched].any()


def test_a_batch_of_more_slices_than_one_syscall_takes(peer, local):
    transport, mem, _ = local
    mem[:] = np.random.default_rng(4).integers(0, 256, SIZE, dtype=np.uint8)
    slices = scattered(3000, 256, seed=5)  # about three process_vm_readv calls of IOV_MAX iovecs
    submit(transport, peer.info, Direction.WRITE, slices, b"many").wait(10)
    _, got, _, _, seen = peer("inbox")[0][-1]
    assert len(got) == 3000
    assert seen == [digest(mem[s.local_offset:s.local_offset + s.length]) for s in slices]


def test_a_large_batch_split_across_threads_arrives_whole():
    size = 16 << 20
    config = ShmConfig(copy_threads=4, parallel_min_bytes=1 << 20)
    process = PeerProcess(size=size, config=config)
    transport, mem, _, _ = make_local(config, size=size)
    try:
        mem[:] = np.random.default_rng(8).integers(0, 256, size, dtype=np.uint8)
        whole = [Slice("mem", 0, "mem", 0, size)]
        submit(transport, process.info, Direction.WRITE, whole, b"big").wait(10)
        assert process("digest", (0, size)) == digest(mem)
        halves = [Slice("mem", 0, "mem", size // 2, size // 2), Slice("mem", size // 2, "mem", 0, size // 2)]
        submit(transport, process.info, Direction.READ, halves).wait(10)  # swaps the halves here
        assert process("digest", (size // 2, size // 2)) == digest(mem[:size // 2])
        assert transport.stats()["received_bytes"] == size and transport.stats()["sent_bytes"] == size
    finally:
        transport.close()
        process.stop()


def test_many_batches_in_flight_complete_in_order(peer, local):
    transport, mem, _ = local
    mem[:] = np.random.default_rng(9).integers(0, 256, SIZE, dtype=np.uint8)
    start = len(peer("inbox")[0])
    batches = [submit(transport, peer.info, Direction.WRITE, [Slice("mem", i * 4096, "mem", i * 4096, 4096)],
                      f"n{i}".encode()) for i in range(100)]
    for batch in batches:
        batch.wait(10)
    messages = [entry[2] for entry in peer("inbox")[0][start:]]
    assert messages == [f"n{i}".encode() for i in range(100)]


def test_messages_without_slices(peer, local):
    transport, _, _ = local
    batch = submit(transport, peer.info, Direction.WRITE, [], None)  # an empty batch still completes
    batch.wait(10)
    note = Batch(0, 0)
    transport.send_message(peer.info, b"are you there", note)
    note.wait(10)
    assert ("local", b"are you there") in peer("inbox")[1]


def test_errors_the_peer_reports_fail_the_batch_and_keep_the_link(peer, local):
    transport, _, _ = local
    outside = [Slice("mem", 0, "mem", SIZE - 100, 200)]
    with pytest.raises(TransferError, match="outside region"):
        submit(transport, peer.info, Direction.WRITE, outside, b"x").wait(10)
    with pytest.raises(TransferError, match="no region"):
        submit(transport, peer.info, Direction.READ, [Slice("mem", 0, "nope", 0, 10)]).wait(10)
    with pytest.raises(TransferError, match="outside region"):  # refused here, before anything is sent
        submit(transport, peer.info, Direction.WRITE, [Slice("mem", SIZE, "mem", 0, 1)]).wait(10)
    peer("set", ("reply", "checksum mismatch in slice 0"))
    try:
        with pytest.raises(ChecksumError):
            submit(transport, peer.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"m").wait(10)
        peer("set", ("reply", "layout differs"))
        with pytest.raises(TransferError, match="layout differs") as caught:
            submit(transport, peer.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"m").wait(10)
        assert not isinstance(caught.value, ChecksumError)
    finally:
        peer("set", ("reply", None))
    submit(transport, peer.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"ok").wait(10)


def test_a_peer_that_dies_fails_the_batches_in_flight_at_once():
    process = PeerProcess()
    transport, _, _, _ = make_local()
    try:
        process("set", ("hold_s", 60.0))  # it takes the batch, then stops answering
        batch = submit(transport, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 4096)], b"x")
        time.sleep(0.5)
        assert not batch.done()
        killed = time.monotonic()
        process.kill()
        with pytest.raises(TransferError, match="closed its control socket|control socket failed"):
            batch.wait(5)
        assert time.monotonic() - killed < 2
        # And a new batch to the dead peer fails at once (connection refused), never hangs.
        with pytest.raises(TransferError, match="cannot connect"):
            submit(transport, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 1)]).wait(5)
    finally:
        transport.close()
        process.stop()


def test_a_peer_that_closes_its_transport_fails_the_batches_in_flight():
    process = PeerProcess()
    transport, _, _, _ = make_local()
    try:
        process("set", ("hold_s", 3.0))
        batch = submit(transport, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 4096)], b"x")
        time.sleep(0.3)
        process("close")  # answered at once: the serving thread is still inside slices_landed
        with pytest.raises(TransferError):
            batch.wait(2)
    finally:
        transport.close()
        process.stop()


def test_closing_fails_what_is_queued_and_refuses_more(peer):
    transport, _, _, _ = make_local()
    transport.close()
    with pytest.raises(TransferError, match="closed"):
        submit(transport, peer.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 1)]).wait(5)


@pytest.mark.parametrize("local_shared, peer_shared", [(False, True), (True, False), (True, True)])
def test_segments_when_cma_is_off(local_shared, peer_shared):
    process = PeerProcess(config=NO_CMA, shared=peer_shared)
    transport, mem, _, segment = make_local(NO_CMA, shared=local_shared)
    try:
        assert transport.cma_reason is not None
        mem[:] = np.random.default_rng(10).integers(0, 256, SIZE, dtype=np.uint8)
        slices = scattered(100, 1024, seed=11)
        submit(transport, process.info, Direction.WRITE, slices, b"seg").wait(10)
        _, got, message, _, seen = process("inbox")[0][-1]
        assert (got, message) == (slices, b"seg")
        assert seen == [digest(mem[s.local_offset:s.local_offset + s.length]) for s in slices]
        process("fill", 12)
        expected = np.random.default_rng(12).integers(0, 256, SIZE, dtype=np.uint8)
        submit(transport, process.info, Direction.READ, [Slice("mem", 0, "mem", 0, SIZE)]).wait(10)
        assert np.array_equal(mem, expected)
    finally:
        transport.close()
        process.stop()
        if segment is not None:
            segment.close()


def test_private_memory_on_both_sides_without_cma_fails_and_says_why():
    process = PeerProcess(config=NO_CMA)
    transport, _, _, _ = make_local(NO_CMA)
    try:
        with pytest.raises(TransferError, match="SharedBuffer"):
            submit(transport, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, 64)], b"x").wait(10)
    finally:
        transport.close()
        process.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start a peer under another uid")
def test_cma_refused_by_the_kernel_falls_back_to_the_peers_segment():
    """A peer under another uid may not read our memory: its probe fails, so it says no CMA and
    we copy into its SharedBuffer ourselves (root may map any segment)."""
    process = PeerProcess(shared=True, uid=65534)
    transport, mem, _, _ = make_local()
    try:
        mem[:] = np.random.default_rng(13).integers(0, 256, SIZE, dtype=np.uint8)
        submit(transport, process.info, Direction.WRITE, [Slice("mem", 0, "mem", 0, SIZE)], b"f").wait(10)
        assert process("digest", (0, SIZE)) == digest(mem)
        (link,) = transport._links.values()
        assert not link.cma and "refused" in link.cma_reason
    finally:
        transport.close()
        process.stop()


def test_can_reach_only_a_peer_on_the_same_host_that_publishes_shm(peer):
    transport = ShmTransport(name="local")
    me = PeerInfo("local", "test-host", {})
    assert transport.can_reach(me, peer.info)
    assert not transport.can_reach(me, PeerInfo("far", "other-host", peer.info.transports))
    assert not transport.can_reach(me, PeerInfo("tcp-only", "test-host", {"tcp": "127.0.0.1:1"}))
    assert not transport.can_reach(me, PeerInfo("garbled", "test-host", {"shm": "not json"}))
    assert json.loads(peer.descriptor)["pid"] == peer.process.pid
