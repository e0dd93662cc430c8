"""TransferEngine in one process: regions, writes, reads, notifications, concurrency, calls, stats."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import xxhash

from messenger.api import ChecksumError, NoTransport, NotifyRefused, PeerInfo, Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.integrity import PendingMessage
from messenger.wire import ENGINE_PREFIX_SIZE
from tests.messenger.engine_pair import make_pair, pair  # noqa: F401 (fixture)

MiB = 1 << 20
TCP = EngineConfig(transports=("tcp",))


def test_register_takes_writable_contiguous_buffers_and_device_addresses():
    engine = TransferEngine("e", TCP)
    array = np.zeros(1000, dtype=np.float32)
    region = engine.register("a", array)
    assert region.length == 4000 and region.address == array.ctypes.data and region.view.nbytes == 4000
    assert engine.register("b", bytearray(10)).length == 10
    with pytest.raises(ValueError, match="read-only"):
        engine.register("c", b"immutable")
    with pytest.raises(ValueError, match="contiguous"):
        engine.register("d", np.zeros((4, 4))[:, 1])
    with pytest.raises(ValueError, match="already registered"):
        engine.register("a", bytearray(1))
    with pytest.raises(ValueError, match="address"):
        engine.register("gpu", device="cuda:0")
    gpu = engine.register("gpu", address=0x7000_0000, length=MiB, device="cuda:0")
    assert gpu.view is None and gpu.address == 0x7000_0000
    engine.unregister("b")
    with pytest.raises(KeyError):
        engine.unregister("b")
    info = engine.start()
    assert {r.name for r in info.regions} == {"a", "gpu"}
    assert info.transports["tcp"].startswith("127.0.0.1:")
    engine.close()


def test_an_engine_listening_on_every_address_publishes_the_advertised_host():
    """A worker started with --host 0.0.0.0 --advertise-host: its peers reach its tcp transport
    and its call lanes there (the hostname may resolve to a loopback address, 127.0.1.1 on Debian)."""
    engine = TransferEngine("wild", EngineConfig(transports=("tcp",), host="0.0.0.0", advertise_host="10.9.8.7"))
    try:
        info = engine.start()
        assert info.transports["tcp"].startswith("10.9.8.7:") and info.call_address.startswith("10.9.8.7:")
    finally:
        engine.close()


def test_config_is_checked():
    with pytest.raises(ValueError, match="unknown"):
        EngineConfig(transports=("carrier-pigeon",))
    with pytest.raises(ValueError, match="timeout"):
        EngineConfig(timeout_s=0)
    with pytest.raises(ValueError, match="16 bytes"):
        EngineConfig(auth_key=b"short")


def test_unbuilt_transports_are_skipped_and_an_unreachable_peer_is_refused():
    engine = TransferEngine("e", EngineConfig(transports=("rdma", "tcp")))
    info = engine.start()
    assert "tcp" in info.transports  # rdma is either not built here or has no device
    with pytest.raises(NoTransport):
        engine.add_peer(PeerInfo("far", "elsewhere", {"carrier-pigeon": "x"}))
    engine.close()


def test_an_engine_with_a_key_never_opens_nixl_which_cannot_check_it():
    """NIXL's agents answer any agent that knows their name: a keyed engine served its regions to
    strangers over it (an audit read and wrote a keyed engine's memory with the wrong key)."""
    key = b"k" * 16
    with pytest.raises(NoTransport, match="cannot authenticate peers"):
        TransferEngine("e", EngineConfig(transports=("nixl",), auth_key=key, call_lanes=False)).start()
    engine = TransferEngine("e", EngineConfig(transports=("nixl", "tcp"), auth_key=key, call_lanes=False))
    try:
        assert set(engine.start().transports) == {"tcp"}
    finally:
        engine.close()


def test_local_and_remote_bounds_are_checked_before_anything_moves(pair):
    with pytest.raises(TransferError, match="outside region 'src'"):
        pair.sender.write("receiver", [Slice("src", len(pair.src) - 10, "dst", 0, 11)])
    with pytest.raises(TransferError, match="outside receiver's region 'dst'"):
        pair.sender.write("receiver", [Slice("src", 0, "dst", len(pair.dst) - 10, 11)])
    with pytest.raises(TransferError, match="no region 'nope'"):
        pair.sender.write("receiver", [Slice("nope", 0, "dst", 0, 1)])
    with pytest.raises(TransferError, match="unknown peer"):
        pair.sender.write("stranger", [Slice("src", 0, "dst", 0, 1)])


def test_numpy_integers_in_slices_move_and_fractions_are_refused(pair):
    """A numpy integer passed Slice's checks, then failed the tcp link's encoder on its sender
    thread, which failed every batch in flight to that peer: slices now hold plain ints."""
    n = np.int64(4096)
    good = [pair.sender.write("receiver", [Slice("src", int(i) * 4096, "dst", int(i) * 4096, 4096)], b"g")
            for i in range(4)]
    odd = pair.sender.write("receiver", [Slice("src", np.int64(4) * n, "dst", np.uint32(4) * 4096, n)], b"n")
    for batch in (*good, odd):
        batch.wait(5)
    assert type(Slice("src", np.int32(0), "dst", 0, n).length) is int
    assert (pair.dst[:5 * 4096] == pair.src[:5 * 4096]).all()
    with pytest.raises(TypeError, match="length must be an integer"):
        Slice("src", 0, "dst", 0, 4096.0)


def test_a_bad_remote_offset_fails_the_batch_and_writes_nothing_outside_the_region():
    p = make_pair()
    try:
        guarded = np.zeros(3 * MiB, dtype=np.uint8)
        p.receiver.register("middle", guarded[MiB:2 * MiB])
        # The sender does not know the region (its PeerInfo predates it), so only the receiver checks.
        assert p.sender.info().region("middle") is None
        batch = p.sender.write("receiver", [Slice("src", 0, "middle", MiB // 2, MiB)], b"x")
        with pytest.raises(TransferError, match="outside region 'middle'"):
            batch.wait(10)
        # Frames inside the region may have landed (the batch failed as a whole); nothing outside did.
        assert not guarded[:MiB].any() and not guarded[2 * MiB:].any()
        assert p.notes and p.notes[-1][2] is not None and "outside region" in p.notes[-1][2]
        # The link survives a refused batch: the next good one lands.
        p.sender.write("receiver", [Slice("src", 0, "middle", 0, MiB)]).wait(10)
        assert (guarded[MiB:2 * MiB] == p.src[:MiB]).all() and not guarded[:MiB].any() and not guarded[2 * MiB:].any()
        assert p.sender.stats()["tcp"]["failures"] == {"transfer": 1}
    finally:
        p.sender.close()
        p.receiver.close()


def test_write_lands_the_bytes_then_notifies(pair):
    slices = [Slice("src", i * MiB + 3, "dst", (15 - i) * MiB, MiB - 7) for i in range(0, 12, 3)]
    seen_in_notify = []
    pair.receiver._on_notify = lambda peer, message, error: seen_in_notify.append(
        (message, error, all((pair.dst[s.remote_offset:s.remote_offset + s.length]
                              == pair.src[s.local_offset:s.local_offset + s.length]).all() for s in slices)))
    pair.sender.write("receiver", slices, b"layer 3").wait(10)
    assert seen_in_notify == [(b"layer 3", None, True)]
    for s in slices:
        assert (pair.dst[s.remote_offset:s.remote_offset + s.length] == pair.src[s.local_offset:s.local_offset + s.length]).all()
    untouched = np.ones(len(pair.dst), dtype=bool)
    for s in slices:
        untouched[s.remote_offset:s.remote_offset + s.length] = False
    assert not pair.dst[untouched].any()


def test_a_batch_without_a_message_does_not_notify(pair):
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 1000)]).wait(10)
    assert pair.notes == [] and (pair.dst[:1000] == pair.src[:1000]).all()


def test_a_message_without_slices_is_delivered(pair):
    pair.sender.write("receiver", [], b"only a note").wait(10)
    assert pair.notes == [("sender", b"only a note", None)]


def test_many_small_and_one_split_slice_land(pair):
    # 3000 slices of 1 KiB (many per frame, not one frame each) and a 12 MiB slice spread over streams.
    small = [Slice("src", i * 2048, "dst", i * 1024, 1024) for i in range(3000)]
    big = [Slice("src", 4 * MiB, "dst", 4 * MiB, 12 * MiB)]
    pair.sender.write("receiver", small + big, b"both").wait(20)
    for s in small[::97] + small[-1:]:
        assert (pair.dst[s.remote_offset:s.remote_offset + 1024] == pair.src[s.local_offset:s.local_offset + 1024]).all()
    assert (pair.dst[4 * MiB:] == pair.src[4 * MiB:]).all()
    assert pair.notes == [("sender", b"both", None)]


def test_read_copies_the_peers_bytes_here(pair):
    pair.receiver.register("remote", np.arange(4 * MiB, dtype=np.uint8) ^ 0x5A)
    pair.sender.add_peer(pair.receiver.info())  # republished with the new region
    pair.sender.register("landing", landing := np.zeros(4 * MiB, dtype=np.uint8))
    expected = np.arange(4 * MiB, dtype=np.uint8) ^ 0x5A
    pair.sender.read("receiver", [Slice("landing", 0, "remote", 2 * MiB, 2 * MiB),
                                  Slice("landing", 3 * MiB, "remote", 5, 1000)]).wait(10)
    assert (landing[:2 * MiB] == expected[2 * MiB:]).all()
    assert (landing[3 * MiB:3 * MiB + 1000] == expected[5:1005]).all()
    assert not landing[2 * MiB:3 * MiB].any()
    with pytest.raises(TransferError, match="no region 'missing'"):
        pair.sender.read("receiver", [Slice("landing", 0, "missing", 0, 10)]).wait(10)
    started = time.monotonic()
    pair.sender.read("receiver", []).wait(10)  # nothing to read: done at once (it waited for the timeout)
    assert time.monotonic() - started < 1.0


def test_32_concurrent_batches_on_32_threads_do_not_mix(pair):
    size = len(pair.dst) // 32
    rng = np.random.default_rng(5)
    pair.sender.register("many", many := rng.integers(0, 256, len(pair.dst), dtype=np.uint8))
    errors = []

    def push(i: int) -> None:
        try:
            # Each thread's batch: 8 slices scattered within its own 1/32 of the destination.
            part = size // 8
            slices = [Slice("many", i * size + k * part, "dst", i * size + (7 - k) * part, part) for k in range(8)]
            pair.sender.write("receiver", slices, i.to_bytes(2, "big")).wait(30)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    part = size // 8
    for i in range(32):
        for k in range(8):
            got = pair.dst[i * size + (7 - k) * part:i * size + (8 - k) * part]
            assert (got == many[i * size + k * part:i * size + (k + 1) * part]).all(), (i, k)
    assert sorted(int.from_bytes(m, "big") for _, m, e in pair.notes if e is None) == list(range(32))


@pytest.mark.parametrize("size", [4096, 4 * MiB, 12 * MiB])
def test_checksums_are_computed_off_the_callers_thread(pair, monkeypatch, size):
    import messenger.integrity as engine_module

    hashed_on = []
    real = engine_module.slice_checksums
    monkeypatch.setattr(engine_module, "slice_checksums",
                        lambda views: hashed_on.append(threading.current_thread().name) or real(views))
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, size // 2), Slice("src", size // 2, "dst", size // 2, size // 2)],
                      b"m").wait(10)
    # Sender and receiver both hashed (small batches on the transports' threads, large on the pool's),
    # never on the thread that called write.
    assert len(hashed_on) >= 2 and threading.current_thread().name not in hashed_on
    assert all(name.startswith(("messenger-hash", "messenger-tcp")) for name in hashed_on)
    # And with checksums off nothing is hashed at all.
    quiet = make_pair(EngineConfig(transports=("tcp",), checksums=False))
    try:
        hashed_on.clear()
        quiet.sender.write("receiver", [Slice("src", 0, "dst", 0, size)], b"m").wait(10)
        assert hashed_on == [] and quiet.notes == [("sender", b"m", None)]
    finally:
        quiet.sender.close()
        quiet.receiver.close()


def test_a_wrong_checksum_fails_the_batch_with_checksum_error_and_tells_on_notify(pair):
    # Hook: the receiver verifies against what the message carries, so a message whose checksum
    # differs from the bytes is exactly what a flipped byte in flight looks like to it. (The
    # wire-level flip through a proxy is in test_tcp_transport.py.)
    sender = pair.sender
    real_submit = sender._peers["receiver"].transport.submit

    def tampering_submit(peer, direction, slices, batch, message):
        good = message.checksums
        bad = PendingMessage(message.payload, _done((good[0] ^ 1, *good[1:])))
        real_submit(peer, direction, slices, batch, bad)

    monkeypatch_peer = dataclasses.replace(sender._peers["receiver"])
    monkeypatch_peer.transport = type("T", (), {"submit": staticmethod(tampering_submit), "name": "tcp"})()
    sender._peers["receiver"] = monkeypatch_peer
    batch = sender.write("receiver", [Slice("src", 0, "dst", 0, MiB), Slice("src", MiB, "dst", MiB, 10)], b"n")
    with pytest.raises(ChecksumError, match="slice 0"):
        batch.wait(10)
    assert len(pair.notes) == 1 and pair.notes[0][1] == b"n" and "ChecksumError" in pair.notes[0][2]
    assert sender.stats()["tcp"]["failures"] == {"checksum": 1}


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_batch_its_receiver_refuses_in_on_notify_fails_at_the_sender(transport):
    """The bytes landed, but nothing on the receiving side will use them (a KV push for a transfer
    that expired there): the sender must not count the batch delivered."""
    p = make_pair(EngineConfig(transports=(transport,), timeout_s=5), size=MiB)
    try:
        def refuse(peer, message, error):
            if message == b"stale":
                raise NotifyRefused("no reservation for transfer t")

        p.receiver._on_notify = refuse
        with pytest.raises(TransferError, match="no reservation for transfer t"):
            p.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"stale").wait(5)
        p.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"wanted").wait(5)  # the link stays up
    finally:
        p.sender.close()
        p.receiver.close()


def _done(value):
    from concurrent.futures import Future

    future = Future()
    future.set_result(value)
    return future


def test_calls_get_replies_errors_and_time_out():
    def on_call(peer: str, request: bytes) -> bytes:
        if request == b"boom":
            raise RuntimeError("handler exploded")
        if request == b"slow":
            time.sleep(3)
        return peer.encode() + b" asked " + request

    p = make_pair(EngineConfig(transports=("tcp",), timeout_s=5), on_call=on_call)
    try:
        assert p.sender.call("receiver", b"where?") == b"sender asked where?"
        with pytest.raises(TransferError, match="handler exploded"):
            p.sender.call("receiver", b"boom")
        started = time.monotonic()
        with pytest.raises(TransferError, match="no reply within 0.5"):
            p.sender.call("receiver", b"slow", timeout_s=0.5)
        assert time.monotonic() - started < 3
        # Concurrent calls get their own replies.
        replies = {}
        threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, p.sender.call("receiver", str(i).encode())))
                   for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert replies == {i: b"sender asked " + str(i).encode() for i in range(16)}
        # The callee learned the caller from the request: it can call back.
        with pytest.raises(TransferError, match="takes no calls"):
            p.receiver.call("sender", b"back")
    finally:
        p.sender.close()
        p.receiver.close()


def test_stats_count_bytes_batches_and_failures(pair):
    for _ in range(3):
        pair.sender.write("receiver", [Slice("src", 0, "dst", 0, MiB)], b"s").wait(10)
    sent = pair.sender.stats()["tcp"]
    assert sent["request_seconds"]["count"] == 3 and sent["failures"] == {}  # counted before wait() returns
    # Both ends count every frame: what one sent, the other received. A stream counts a frame once
    # its send returned, which may be after the peer's ack completed the batch; acks are counted
    # just after they land.
    deadline = time.monotonic() + 5
    while True:
        sent, received = pair.sender.stats()["tcp"], pair.receiver.stats()["tcp"]
        settled = (received["received_bytes"] == sent["sent_bytes"] and sent["received_bytes"] >= 3 * ENGINE_PREFIX_SIZE
                   and received["sent_bytes"] >= 3 * ENGINE_PREFIX_SIZE)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert 3 * MiB < sent["sent_bytes"] < 3 * MiB + 4096  # headers are a few dozen bytes a frame
    assert received["received_bytes"] == sent["sent_bytes"]
    assert pair.sender.stats()["tcp"]["received_bytes"] == pair.receiver.stats()["tcp"]["sent_bytes"] == 3 * ENGINE_PREFIX_SIZE
    with pytest.raises(TransferError):
        pair.sender.read("receiver", [Slice("src", 0, "gone", 0, 10)]).wait(10)
    assert pair.sender.stats()["tcp"]["failures"] == {"transfer": 1}


def test_digest_helper_agrees_with_xxh3():
    from messenger.integrity import slice_checksums

    data = np.arange(1000, dtype=np.uint8)
    assert slice_checksums([memoryview(data)[:10], memoryview(data)]) == (
        xxhash.xxh3_64_intdigest(data[:10].tobytes()), xxhash.xxh3_64_intdigest(data.tobytes()))
