"""Once a batch completed, nothing lands in its local memory any more (messenger/api.py's contract):
a transport writes a READ's bytes under Batch.begin_landing, a completion meanwhile (the
watchdog's timeout, a READ_ERR, a broken link) is held until the landing ends, and a waiter never
wakes while its memory is still being written. Each engine test snapshots the caller's memory in
the done-callback of its batch (the moment a waiter wakes): all of the landing must be in by then.
The peer's side waits for `woke`, which the old engine set while a landing was still under way."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from messenger.api import Batch, Slice, TimedOut, TransferError
from messenger.engine import EngineConfig, TransferEngine
from tests.messenger.engine_pair import make_pair

KiB = 1 << 10


# --- Batch: landings and held completions -------------------------------------------------------

def test_a_completion_during_a_landing_is_held_until_it_ends_and_the_first_one_wins():
    batch = Batch(0, 0)
    woke = []
    batch.add_done_callback(lambda b: woke.append(b.error))
    assert batch.begin_landing()
    assert batch.begin_landing()  # two streams land frames of one batch at once
    batch.complete(TimedOut("the watchdog"))
    batch.complete(TransferError("a READ_ERR on another stream"))
    assert not batch.done() and not woke
    assert not batch.begin_landing()  # ending: no new landing starts
    batch.end_landing()
    assert not batch.done()  # the other stream still writes
    batch.end_landing()
    assert batch.done() and len(woke) == 1 and isinstance(woke[0], TimedOut)
    assert not batch.begin_landing()


def test_without_a_landing_a_completion_takes_effect_at_once():
    batch = Batch(0, 0)
    assert batch.begin_landing()
    batch.end_landing()  # nothing held: ending a landing completes nothing
    assert not batch.done()
    batch.complete(None)
    assert batch.done() and batch.error is None


# --- tcp ------------------------------------------------------------------------------------------

class ServedReads:
    """The tcp serving side's READ answers, frame by frame: `plan[index]` is "trickle" (half of
    the frame, then a byte at a time until `until`, and until `woke` or `woke_wait_s` passed, then
    the rest), "refuse" (a READ_ERR, once `before_refusing` returned), "break" (half of the frame,
    then the connection closes), or absent (answered as usual)."""

    def __init__(self, monkeypatch, plan: dict[int, str], woke: threading.Event, until: float = 0.0,
                 woke_wait_s: float = 1.0) -> None:
        from messenger.tcp_transport import TcpTransport

        self.plan, self.woke, self.until, self.woke_wait_s = plan, woke, until, woke_wait_s
        self.before_refusing = lambda: None
        self.real = TcpTransport._serve_read
        monkeypatch.setattr(TcpTransport, "_serve_read",
                            lambda transport, conn, batch_id, var: self.serve(transport, conn, batch_id, var))

    def serve(self, transport, conn, batch_id, var) -> None:
        from messenger.wire import Kind, encode_engine_prefix

        for index, segments in msgspec.msgpack.decode(var):
            how = self.plan.get(index)
            if how is None:
                self.real(transport, conn, batch_id, msgspec.msgpack.encode([[index, segments]]))
            elif how == "refuse":
                self.before_refusing()
                conn.sendall(encode_engine_prefix(Kind.READ_ERR, batch_id, index, b"refused for the test", 0))
            else:
                data = b"".join(bytes(transport.regions.get(r).view[o:o + n]) for r, o, n in segments)
                half = len(data) // 2
                conn.sendall(encode_engine_prefix(Kind.READ_DATA, batch_id, index, b"", len(data)) + data[:half])
                if how == "break":
                    conn.shutdown(2)  # its reader sees the end: this connection is done
                    return
                sent, started = half, time.monotonic()
                while sent < len(data) - 1 and (time.monotonic() < self.until or (
                        not self.woke.is_set() and time.monotonic() - started < self.woke_wait_s)):
                    conn.sendall(data[sent:sent + 1])  # progress: the caller's socket never times out
                    sent += 1
                    self.woke.wait(0.02)
                conn.sendall(data[sent:])


def _read_pair(streams: int, timeout_s: float):
    p = make_pair(EngineConfig(transports=("tcp",), tcp_streams=streams, timeout_s=timeout_s, call_lanes=False),
                  size=1 << 20)
    p.dst[:] = 0x5A  # the bytes a read fetches (the receiver's); p.src, the caller's, starts zero
    p.src[:] = 0
    return p


def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.002)


def _watch(batch: Batch, memory: np.ndarray, n: int, woke: threading.Event) -> list:
    """What `memory[:n]` held when `batch` completed (when its waiter wakes); read it once `woke`
    is set (a waiter may wake before the done-callbacks ran)."""
    seen = []
    batch.add_done_callback(lambda b: (seen.append(memory[:n].copy()), woke.set()))
    return seen


def test_a_read_timing_out_mid_frame_wakes_its_waiter_only_once_the_frame_is_in(monkeypatch):
    timeout, n = 0.5, 64 * KiB
    woke = threading.Event()
    served = ServedReads(monkeypatch, {0: "trickle"}, woke, woke_wait_s=0.0)
    p = _read_pair(1, timeout)
    try:
        served.until = time.monotonic() + timeout + 0.3  # the frame is still landing at the deadline
        batch = p.sender.read("receiver", [Slice("src", 0, "dst", 0, n)])
        seen = _watch(batch, p.src, n, woke)
        with pytest.raises(TimedOut):
            batch.wait(10)
        assert woke.wait(5) and (seen[0] == 0x5A).all()  # all of it was in when the waiter woke
        p.src[:n] = 0xAA  # the caller's memory is its own again
        p.sender.read("receiver", [Slice("src", n, "dst", 0, KiB)]).wait(5)  # the link stayed in step
        assert (p.src[:n] == 0xAA).all() and (p.src[n:n + KiB] == 0x5A).all()
    finally:
        p.sender.close()
        p.receiver.close()


def test_a_read_err_on_one_stream_waits_for_the_frame_another_stream_lands(monkeypatch):
    frame = 256 * KiB  # two frames of this size, one per stream (tcp_link.plan_frames)
    woke = threading.Event()
    served = ServedReads(monkeypatch, {0: "trickle", 1: "refuse"}, woke)
    p = _read_pair(2, 5.0)
    # The refusal goes out once frame 0 is landing: its first half is in the caller's memory.
    served.before_refusing = lambda: _until(lambda: p.src[frame // 2 - 1] == 0x5A)
    try:
        batch = p.sender.read("receiver", [Slice("src", 0, "dst", 0, 2 * frame)])
        seen = _watch(batch, p.src, frame, woke)
        with pytest.raises(TransferError, match="refused for the test"):
            batch.wait(10)
        assert woke.wait(5) and (seen[0] == 0x5A).all()  # frame 0 landed whole before the READ_ERR took effect
    finally:
        p.sender.close()
        p.receiver.close()


def test_a_link_that_breaks_mid_frame_still_ends_the_read_at_once(monkeypatch):
    woke = threading.Event()
    ServedReads(monkeypatch, {0: "break"}, woke)
    p = _read_pair(1, 10.0)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match="lost|closed"):
            p.sender.read("receiver", [Slice("src", 0, "dst", 0, 64 * KiB)]).wait(5)
        assert time.monotonic() - started < 5  # the landing ended with its recv, not at the timeout
    finally:
        p.sender.close()
        p.receiver.close()


# --- shm: this side's own copy of a read -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["pulled", "done"])
def test_an_shm_read_timing_out_mid_copy_wakes_its_waiter_only_once_the_copy_is_done(monkeypatch, mode):
    """This side copies a read itself: by process_vm_readv from the owner ("pulled"), or, without
    cross-memory attach, from the owner's shared segment mapped here ("done"). The copy straddles
    the batch's deadline here (held back until the waiter would have woken, as the old engine did)."""
    from messenger.segments import SharedBuffer
    from messenger.shm import ShmConfig, ShmTransport

    timeout, n = 0.5, 64 * KiB
    woke, stall = threading.Event(), threading.Event()
    real_copy = ShmTransport.copy

    def slow_copy(self, copies, *, write, pid):
        if stall.is_set() and not write:
            woke.wait(timeout + 1.0)
        real_copy(self, copies, write=write, pid=pid)

    monkeypatch.setattr(ShmTransport, "copy", slow_copy)
    config = EngineConfig(transports=("shm",), timeout_s=timeout, call_lanes=False)
    if mode == "done":
        object.__setattr__(config, "shm", ShmConfig(use_cma=False))
    reader, owner = TransferEngine("reader", config), TransferEngine("owner", config)
    segment = SharedBuffer(n)
    mine = np.zeros(n, np.uint8)
    try:
        segment.array[:] = 0x5A
        reader.register("mine", mine)
        owner.register("theirs", segment.array)
        reader.start()
        reader.add_peer(owner.start())
        reader.read("owner", [Slice("mine", 0, "theirs", 0, 16)]).wait(5)  # connected, and knows where
        link = next(iter(reader._transports["shm"]._links.values()))
        if mode == "pulled" and link.pull_pid is None:
            pytest.skip("this host allows no cross-memory reads of a peer")
        mine[:] = 0
        stall.set()
        batch = reader.read("owner", [Slice("mine", 0, "theirs", 0, n)])
        seen = _watch(batch, mine, n, woke)
        with pytest.raises(TimedOut):
            batch.wait(10)
        assert woke.wait(5) and (seen[0] == 0x5A).all()  # the copy was done when the waiter woke
    finally:
        reader.close()
        owner.close()
        segment.close()
