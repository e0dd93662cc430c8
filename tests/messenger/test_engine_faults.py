"""The engine under faults found by an audit: many open fds, a raising done-callback, a restarted
caller, close with batches still watched, and how a silent tcp peer is counted."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import numpy as np
import pytest

from messenger.api import Batch, PeerInfo, RegionInfo, Slice, TimedOut, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.watchdog import Watchdog
from tests.messenger.engine_pair import make_pair

MiB = 1 << 20
FDS = 1100


def test_tcp_works_when_its_sockets_get_fds_above_1024():
    """vLLM raises the fd limit and a busy worker passes 1024: select.select fails there."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS + 200:
        pytest.skip(f"the fd hard limit {hard} is too low")
    if soft != resource.RLIM_INFINITY and soft < FDS + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS + 200, hard))
    p = make_pair(EngineConfig(transports=("tcp",), timeout_s=5, call_lanes=False),
                  on_call=lambda peer, request: b"got " + request, size=MiB)
    hog = [os.open(os.devnull, os.O_RDONLY) for _ in range(FDS)]  # the links connect after these
    try:
        p.sender.write("receiver", [Slice("src", 0, "dst", 0, MiB)], b"n").wait(5)
        assert (p.dst == p.src).all()
        assert p.sender.call("receiver", b"hi") == b"got hi"
        link = next(iter(p.sender._transports["tcp"]._links.values()))
        assert min(s.sock.fileno() for s in link.streams if s.sock is not None) >= 1024
    finally:
        for fd in hog:
            os.close(fd)
        p.sender.close()
        p.receiver.close()
        if soft != resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_raising_done_callback_neither_stops_the_others_nor_kills_the_watchdog():
    watchdog = Watchdog()
    try:
        seen = []
        first = Batch(0, 0)
        first.add_done_callback(lambda b: 1 / 0)  # a user's bug
        first.add_done_callback(lambda b: seen.append(b.error))
        watchdog.watch(first, 0.05, "first")
        time.sleep(0.3)
        assert first.done() and len(seen) == 1 and isinstance(seen[0], TimedOut)
        second = Batch(0, 0)
        watchdog.watch(second, 0.05, "second")
        with pytest.raises(TransferError, match="second timed out"):
            second.wait(2)  # the watchdog still runs
    finally:
        watchdog.close()


def test_a_raising_done_callback_on_an_acked_batch_keeps_the_tcp_link_working():
    """The ack's reader thread runs the callbacks: an exception there must not end it."""
    p = make_pair(EngineConfig(transports=("tcp",), timeout_s=2, tcp_streams=1, call_lanes=False), size=MiB)
    try:
        gate = threading.Event()
        p.receiver._on_notify = lambda peer, message, error: gate.wait(2)  # hold the ack until the callback is in
        batch = p.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n")
        batch.add_done_callback(lambda b: 1 / 0)
        gate.set()
        batch.wait(5)
        p.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    finally:
        p.sender.close()
        p.receiver.close()


def test_a_restarted_caller_does_not_get_its_predecessors_reply():
    """Calls through a transport: the callee answers to the caller's name; ids must not repeat."""
    cfg = EngineConfig(transports=("tcp",), timeout_s=5, call_lanes=False)

    def handler(peer, request):
        time.sleep(0.6 if request == b"first" else 1.0)
        return b"answer to " + request

    callee = TransferEngine("callee", cfg)
    info = callee.start(on_call=handler)
    old = TransferEngine("caller", cfg)
    try:
        old.start()
        old.add_peer(info)
        with pytest.raises(TransferError, match="no reply"):
            old.call("callee", b"first", timeout_s=0.1)
        old.close()  # the caller restarts: same name, a new engine
        new = TransferEngine("caller", cfg)
        try:
            new.start()
            new.add_peer(info)
            assert new.call("callee", b"second", timeout_s=3) == b"answer to second"
        finally:
            new.close()
    finally:
        old.close()
        callee.close()


def test_closing_the_watchdog_fails_what_it_watches():
    watchdog = Watchdog()
    batch = Batch(0, 0)
    watchdog.watch(batch, 60, "a write to a peer")
    watchdog.close()
    with pytest.raises(TransferError, match="engine closed"):
        batch.wait(0.5)


def test_a_silent_tcp_peer_is_counted_as_a_timeout():
    silent = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(silent.accept()), daemon=True).start()
    engine = TransferEngine("w", EngineConfig(transports=("tcp",), timeout_s=3, call_lanes=False))
    try:
        engine.register("src", np.zeros(4096, dtype=np.uint8))
        engine.start()
        engine.add_peer(PeerInfo("silent", "x", {"tcp": f"127.0.0.1:{silent.getsockname()[1]}"},
                                 (RegionInfo("dst", MiB),)))
        batch = engine.write("silent", [Slice("src", 0, "dst", 0, 4096)], b"n")
        time.sleep(0.3)  # its frames went out
        link = next(iter(engine._transports["tcp"]._links.values()))
        link._last_heard -= 100  # silent for long: the link's own check fails it, before the watchdog
        with pytest.raises(TransferError, match="silent for") as info:
            batch.wait(5)
        assert isinstance(info.value, TimedOut)
        assert engine.stats()["tcp"]["failures"] == {"timeout": 1}
    finally:
        engine.close()
        silent.close()
        for conn, _ in accepted:
            conn.close()


def test_a_tcp_link_idle_past_its_timeout_does_not_fail_its_next_batch_as_silent():
    """Silence is what a peer owes: a link that sat idle longer than timeout_s (its last frame long
    ago) must give its next batch the whole timeout, not fail it at the reader's next poll."""
    slow = threading.Event()

    def on_notify(peer, message, error):
        if message == b"slow":
            time.sleep(1.5)  # within the timeout, past the reader's 1 s poll

    sender, receiver = (TransferEngine(name, EngineConfig(transports=("tcp",), timeout_s=3, call_lanes=False))
                        for name in ("a", "b"))
    try:
        sender.register("src", np.ones(4096, dtype=np.uint8))
        receiver.register("dst", np.zeros(4096, dtype=np.uint8))
        sender.start()
        sender.add_peer(receiver.start(on_notify=on_notify))
        sender.write("b", [Slice("src", 0, "dst", 0, 4096)], b"fast").wait(5)
        link = next(iter(sender._transports["tcp"]._links.values()))
        link._last_heard -= 100  # idle for long since its last frame
        sender.write("b", [], b"slow").wait(5)  # raised TimedOut "silent for 3 s" before
        slow.set()
    finally:
        sender.close()
        receiver.close()
    assert slow.is_set()
