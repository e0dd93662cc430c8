"""The tcp transport: frame planning, a byte flipped on the wire, auth, and peers in other processes
(writes and reads with content checks, a killed peer, a silent peer)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import xxhash

from messenger.api import ChecksumError, Slice, TransferError
from messenger.engine import EngineConfig
from messenger.tcp_link import MAX_FRAME_BYTES, MAX_FRAME_SEGMENTS, MIN_FRAME_BYTES, plan_frames
from tests.messenger.engine_pair import make_pair
from tests.messenger.engine_peer import RANGE, REGION, PeerProcess

MiB = 1 << 20
KEY = b"k" * 32


# --- planning ------------------------------------------------------------------------------------

def _covered(frames):
    return sorted((seg[0], seg[1], seg[2], seg[3], seg[4]) for frame in frames for seg in frame)


def test_neighbours_coalesce_and_small_slices_share_frames():
    slices = [Slice("a", i * 100, "b", 1000 + i * 100, 100) for i in range(50)]
    assert plan_frames(slices, 4) == [[("a", 0, "b", 1000, 5000)]]
    scattered = [Slice("a", i * 200, "b", i * 300, 100) for i in range(1000)]
    frames = plan_frames(scattered, 4)
    assert all(len(f) <= MAX_FRAME_SEGMENTS for f in frames) and len(frames) == -(-1000 // MAX_FRAME_SEGMENTS)
    assert _covered(frames) == sorted(("a", s.local_offset, "b", s.remote_offset, 100) for s in scattered)


def test_large_slices_are_split_so_every_stream_gets_work():
    frames = plan_frames([Slice("a", 0, "b", 0, 16 * MiB)], 4)
    assert [f[0][4] for f in frames] == [4 * MiB] * 4
    assert [f[0][1] for f in frames] == [0, 4 * MiB, 8 * MiB, 12 * MiB] == [f[0][3] for f in frames]
    frames = plan_frames([Slice("a", i * 32 * MiB, "b", i * 16 * MiB, 16 * MiB) for i in range(8)], 4)
    assert len(frames) == 32 and all(sum(s[4] for s in f) == MAX_FRAME_BYTES for f in frames)
    tiny = plan_frames([Slice("a", 0, "b", 0, 300 * 1024)], 4)
    assert [sum(s[4] for s in f) for f in tiny] == [MIN_FRAME_BYTES, 300 * 1024 - MIN_FRAME_BYTES]


# --- a byte flipped on the wire ------------------------------------------------------------------

class FlippingProxy:
    """Forwards one tcp connection to `target`, flipping the byte at `position` of the client's
    stream (well inside a data frame's payload, past the handshake and headers), or with `cut`,
    closing both sides there instead (a sender that dies mid-batch)."""

    def __init__(self, target: str, position: int, cut: bool = False):
        self.target, self.position, self.cut = target, position, cut
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flipped = False
        self.sockets = [self.listener]
        threading.Thread(target=self._run, daemon=True).start()

    def close(self):
        for s in self.sockets:
            s.close()

    def _run(self):
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        host, port = self.target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        self.sockets += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def _pump(self, source, sink, flip):
        seen = 0
        try:
            while chunk := source.recv(1 << 16):
                if flip and seen <= self.position < seen + len(chunk):
                    if self.cut:
                        sink.sendall(chunk[:self.position - seen])
                        self.flipped = True
                        return
                    chunk = bytearray(chunk)
                    chunk[self.position - seen] ^= 0x01
                    self.flipped = True
                seen += len(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.mark.parametrize("checksums", [True, False])
def test_a_byte_flipped_on_the_wire_is_caught_by_the_checksum(checksums):
    p = make_pair(EngineConfig(transports=("tcp",), tcp_streams=1, checksums=checksums))
    info = p.receiver.info()
    proxy = FlippingProxy(info.transports["tcp"], position=100_000)
    try:
        p.sender.add_peer(dataclasses.replace(info, transports={"tcp": proxy.address}))
        batch = p.sender.write("receiver", [Slice("src", 0, "dst", 0, 2 * MiB)], b"kv")
        if checksums:
            with pytest.raises(ChecksumError, match="slice 0"):
                batch.wait(10)
            assert p.notes[0][:2] == ("sender", b"kv") and "ChecksumError" in p.notes[0][2]
        else:  # the control: without checksums the same flip goes unnoticed
            batch.wait(10)
            assert p.notes == [("sender", b"kv", None)]
        assert proxy.flipped
        assert int(np.count_nonzero(p.dst[:2 * MiB] != p.src[:2 * MiB])) == 1
    finally:
        proxy.close()
        p.sender.close()
        p.receiver.close()


def test_a_sender_lost_mid_batch_fails_both_sides_at_once():
    p = make_pair(EngineConfig(transports=("tcp",), tcp_streams=1, timeout_s=30))
    info = p.receiver.info()
    proxy = FlippingProxy(info.transports["tcp"], position=1_000_000, cut=True)
    try:
        p.sender.add_peer(dataclasses.replace(info, transports={"tcp": proxy.address}))
        started = time.monotonic()
        batch = p.sender.write("receiver", [Slice("src", 0, "dst", 0, 8 * MiB)], b"layer 7")
        with pytest.raises(TransferError):
            batch.wait(10)
        deadline = time.monotonic() + 5
        while not p.notes and time.monotonic() < deadline:
            time.sleep(0.01)
        # The receiver knew the batch's message (it goes first) and was told at once, not after 30 s.
        assert proxy.flipped and len(p.notes) == 1
        assert p.notes[0][:2] == ("sender", b"layer 7") and "closed" in p.notes[0][2]
        assert time.monotonic() - started < 5
    finally:
        proxy.close()
        p.sender.close()
        p.receiver.close()


def test_a_batch_that_timed_out_is_failed_on_both_sides_and_spares_the_others(monkeypatch):
    """A WRITE that times out while its frames go out: no more of them are sent (its memory may
    be the caller's again: here its region is unregistered at once, as the KV sender does), the
    receiver hears that it failed (not that it landed, nor nothing), and the next batch on the
    same link lands."""
    from messenger.tcp_transport import TcpTransport

    stall = threading.Event()
    stall.set()
    land = TcpTransport._on_data

    def slow_receiver(self, *args, **kwargs):
        if stall.is_set():
            time.sleep(0.25)  # 10 frames of 4 MiB: 2.5 s, against a timeout of 1 s
        return land(self, *args, **kwargs)

    monkeypatch.setattr(TcpTransport, "_on_data", slow_receiver)
    p = make_pair(EngineConfig(transports=("tcp",), tcp_streams=1, timeout_s=1.0), size=48 * MiB)
    other = np.full(MiB, 7, dtype=np.uint8)
    p.sender.register("other", other)
    try:
        first = p.sender.write("receiver", [Slice("src", 0, "dst", 0, 40 * MiB)], b"first")

        def timed_out(batch):
            stall.clear()
            p.sender.unregister("src")

        first.add_done_callback(timed_out)
        with pytest.raises(TransferError, match="timed out"):
            first.wait(5)
        p.sender.write("receiver", [Slice("other", 0, "dst", 44 * MiB, MiB)], b"second").wait(5)
        assert (p.dst[44 * MiB:45 * MiB] == 7).all()
        deadline = time.monotonic() + 5
        while len(p.notes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        notes = {message: error for _, message, error in p.notes}
        assert notes[b"second"] is None and "gave up" in notes[b"first"], p.notes
        assert not p.receiver._transports["tcp"]._inbound  # nothing left waiting for frames
    finally:
        p.sender.close()
        p.receiver.close()


# --- auth ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sender_key,receiver_key,ok", [
    (KEY, KEY, True), (b"x" * 32, KEY, False), (None, KEY, False), (KEY, None, False)])
def test_connections_prove_the_shared_key(sender_key, receiver_key, ok):
    p = make_pair(EngineConfig(transports=("tcp",), auth_key=receiver_key, timeout_s=3))
    try:
        if sender_key != receiver_key:
            p.sender.close()
            from messenger.engine import TransferEngine

            p.sender = TransferEngine("sender", EngineConfig(transports=("tcp",), auth_key=sender_key, timeout_s=3))
            p.sender.register("src", p.src)
            p.sender.start()
            p.sender.add_peer(p.receiver.info())
        batch = p.sender.write("receiver", [Slice("src", 0, "dst", 0, MiB)], b"m")
        if ok:
            batch.wait(10)
            assert (p.dst[:MiB] == p.src[:MiB]).all()
        else:
            started = time.monotonic()
            with pytest.raises(TransferError):
                batch.wait(10)
            assert time.monotonic() - started < 5
            assert not p.dst.any() and p.notes == []
    finally:
        p.sender.close()
        p.receiver.close()


# --- a peer in another process -------------------------------------------------------------------

def _engine_and_child(config: EngineConfig, size: int = 8 << 20):
    from messenger.engine import TransferEngine

    child = PeerProcess(config, size=size)
    engine = TransferEngine("parent", config)
    src = np.random.default_rng(3).integers(0, 256, 64 * MiB, dtype=np.uint8)
    engine.register("src", src)
    engine.start()
    assert engine.add_peer(child.info) == "tcp"
    return engine, child, src


def test_write_read_and_call_across_processes():
    engine, child, src = _engine_and_child(EngineConfig(transports=("tcp",), auth_key=KEY))
    try:
        # Write two ranges; the child hashes them inside on_notify (the bytes must be there then).
        slices = [Slice("src", 5 * MiB, REGION, MiB, 3 * MiB), Slice("src", 100, REGION, 4 * MiB + 1, 1000)]
        engine.write("child", slices[:1], RANGE.pack(MiB, 3 * MiB)).wait(10)
        assert child.notification() == ("parent", RANGE.pack(MiB, 3 * MiB), None,
                                        xxhash.xxh3_64_intdigest(src[5 * MiB:8 * MiB]))
        engine.write("child", slices[1:], RANGE.pack(4 * MiB + 1, 1000)).wait(10)
        assert child.notification()[3] == xxhash.xxh3_64_intdigest(src[100:1100])
        # Read back the child's whole region: what we wrote, and its own bytes elsewhere.
        engine.register("back", back := np.zeros(8 * MiB, dtype=np.uint8))
        engine.read("child", [Slice("back", 0, REGION, 0, 8 * MiB)]).wait(10)
        expected = child.expected.copy()
        expected[MiB:4 * MiB] = src[5 * MiB:8 * MiB]
        expected[4 * MiB + 1:4 * MiB + 1001] = src[100:1100]
        assert (back == expected).all()
        assert engine.call("child", b"hello") == b"child got hello"
        with pytest.raises(TransferError, match="asked to fail"):
            engine.call("child", b"fail")
    finally:
        engine.close()
        child.stop()


def test_a_killed_peer_fails_its_batches_at_once():
    engine, child, _ = _engine_and_child(EngineConfig(transports=("tcp",), timeout_s=10))
    try:
        engine.write("child", [Slice("src", 0, REGION, 0, MiB)]).wait(10)  # connected and working
        stop = threading.Event()
        outcomes = []

        def hammer():
            while not stop.is_set():
                batch = engine.write("child", [Slice("src", 0, REGION, 0, 8 * MiB)])
                started = time.monotonic()
                try:
                    batch.wait(30)
                except TransferError as exc:
                    outcomes.append((time.monotonic() - started, exc))
                    return

        thread = threading.Thread(target=hammer)
        thread.start()
        time.sleep(0.3)
        killed = time.monotonic()
        os.kill(child.process.pid, signal.SIGKILL)
        thread.join(15)
        stop.set()
        assert outcomes, "no batch failed after the peer was killed"
        assert time.monotonic() - killed < 5  # well within timeout_s (10): the broken connection, not the watchdog
        with pytest.raises(TransferError):
            engine.write("child", [Slice("src", 0, REGION, 0, MiB)]).wait(10)
        with pytest.raises(TransferError):
            engine.call("child", b"anyone?")
    finally:
        stop.set()
        engine.close()
        child.stop()


def test_a_silent_peer_fails_its_batches_within_the_timeout():
    timeout_s = 2.0
    engine, child, _ = _engine_and_child(EngineConfig(transports=("tcp",), timeout_s=timeout_s))
    try:
        engine.write("child", [Slice("src", 0, REGION, 0, MiB)]).wait(10)
        os.kill(child.process.pid, signal.SIGSTOP)  # alive, connections open, answering nothing
        started = time.monotonic()
        batches = [engine.write("child", [Slice("src", 0, REGION, 0, 8 * MiB)]) for _ in range(4)]
        for batch in batches:
            with pytest.raises(TransferError):
                batch.wait(3 * timeout_s)
        assert time.monotonic() - started < timeout_s + 4  # bounded by the timeout (slack: a loaded machine)
        started = time.monotonic()
        with pytest.raises(TransferError):
            engine.call("child", b"hello?")
        assert time.monotonic() - started < timeout_s + 4
        assert engine.stats()["tcp"]["failures"].get("timeout", 0) >= 4
    finally:
        os.kill(child.process.pid, signal.SIGCONT)
        engine.close()
        child.stop()


def test_a_closed_transport_stops_listening():
    p = make_pair()
    host, _, port = p.receiver.info().transports["tcp"].rpartition(":")
    p.sender.close()
    p.receiver.close()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_a_peer_that_never_answers_the_handshake_is_a_timeout_not_a_wrong_key():
    """A frozen peer must not be reported as one with another cluster token."""
    from messenger.handshake import HandshakeError, client_handshake

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with socket.create_connection(listener.getsockname(), timeout=0.3) as sock:
            with pytest.raises(TimeoutError, match="did not answer the handshake") as info:
                client_handshake(sock, KEY)
            assert not isinstance(info.value, HandshakeError)
    finally:
        listener.close()
