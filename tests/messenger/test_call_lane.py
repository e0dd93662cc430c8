"""Call lanes (messenger/call_lane.py) through two real engines: calls ride their own connection,
attachments land in the caller's buffers, and a lane that cannot be used gives way or an error."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from messenger.api import CallReply, PeerInfo, TransferError
from messenger.engine import EngineConfig, TransferEngine
from tests.messenger.engine_pair import make_pair

KEY = b"k" * 32


def _close(p) -> None:
    p.sender.close()
    p.receiver.close()


def test_a_call_rides_its_lane_not_the_transport():
    threads = []
    p = make_pair(on_call=lambda peer, request: threads.append(threading.current_thread().name) or b"ok")
    try:
        before = p.sender.stats()["tcp"]["sent_bytes"]
        assert p.sender.call("receiver", b"x") == b"ok"
        assert p.sender.call("receiver", b"y") == b"ok"
        assert p.sender.stats()["tcp"]["sent_bytes"] == before  # nothing went through the tcp transport
        lane = p.sender.stats()["lane"]
        assert lane["request_seconds"]["count"] == 2 and lane["sent_bytes"] > 2 and lane["received_bytes"] > 4
        deadline = time.monotonic() + 5  # the callee counts a reply once its send returned, maybe after the caller read it
        while time.monotonic() < deadline and p.receiver.stats()["lane"]["sent_bytes"] < lane["received_bytes"]:
            time.sleep(0.01)
        served = p.receiver.stats()["lane"]
        assert served["received_bytes"] == lane["sent_bytes"] and served["sent_bytes"] == lane["received_bytes"]
        assert threads[0].startswith("messenger-lane-") and threads[0] == threads[1]  # one lane, kept
        assert p.receiver.info().call_address and p.receiver.info().call_address != p.receiver.info().transports["tcp"]
    finally:
        _close(p)


@pytest.mark.parametrize("lanes", [True, False], ids=["lane", "through-tcp"])
def test_an_attachment_lands_in_the_callers_buffers_and_is_released_once(lanes):
    blocks = np.random.default_rng(3).integers(0, 256, (3, 1000), dtype=np.uint8)
    released = []

    def on_call(peer, request):
        return CallReply(b"head:" + request, [blocks[0], blocks[1][:500], blocks[2]], lambda: released.append(1))

    p = make_pair(EngineConfig(transports=("tcp",), call_lanes=lanes), on_call=on_call)
    try:
        landing = np.zeros(2500, dtype=np.uint8)
        seen = []

        def into(body, nbytes):
            seen.append((bytes(body), nbytes))
            return [landing[:1200], landing[1200:]]

        assert p.sender.call("receiver", b"q", into=into) == b"head:q"
        assert seen == [(b"head:q", 2500)]
        assert np.array_equal(landing, np.concatenate([blocks[0], blocks[1][:500], blocks[2]]))
        flat = p.sender.call("receiver", b"r")  # no sink: the attachment follows the body
        assert bytes(flat) == b"head:r" + landing.tobytes()
        # The callee releases an attachment once its send returns, which may be just after the
        # caller has read the reply: wait a moment for the second, then check none came twice.
        deadline = time.monotonic() + 5.0
        while len(released) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert released == [1, 1]
    finally:
        _close(p)


def test_a_sink_that_refuses_or_misfits_fails_the_call_and_the_next_call_works():
    p = make_pair(on_call=lambda peer, request: CallReply(b"h", [b"x" * 100]))
    try:
        def refuse(body, nbytes):
            raise ValueError("no room")

        with pytest.raises(ValueError, match="no room"):
            p.sender.call("receiver", b"a", into=refuse)
        with pytest.raises(TransferError, match="hold 50 B"):
            p.sender.call("receiver", b"b", into=lambda body, n: [bytearray(50)])
        assert p.sender.stats()["lane"]["failures"] == {"transfer": 2}
        assert bytes(p.sender.call("receiver", b"c")) == b"h" + b"x" * 100
    finally:
        _close(p)


def test_a_lane_the_callee_dropped_is_redialled():
    p = make_pair(on_call=lambda peer, request: b"got " + request)
    try:
        assert p.sender.call("receiver", b"1") == b"got 1"
        server = p.receiver._lane_server
        with server._lock:
            lanes = list(server._lanes)
        for lane in lanes:  # as a restart or a middlebox would
            lane.shutdown(socket.SHUT_RDWR)
        assert p.sender.call("receiver", b"2") == b"got 2"
    finally:
        _close(p)


def test_a_peer_without_lanes_or_whose_lane_is_unreachable_is_called_through_its_transport():
    p = make_pair(on_call=lambda peer, request: threading.current_thread().name.encode())
    try:
        info = p.receiver.info()
        for call_address in ("", _closed_port()):
            p.sender.add_peer(PeerInfo(info.name, info.host_id, info.transports, info.regions, call_address))
            assert p.sender.call("receiver", b"?").startswith(b"messenger-call-")  # the engine's call pool
    finally:
        _close(p)


def test_lanes_prove_the_shared_key():
    p = make_pair(EngineConfig(transports=("tcp",), auth_key=KEY, timeout_s=3), on_call=lambda peer, r: b"ok " + r)
    stranger = TransferEngine("stranger", EngineConfig(transports=("tcp",), auth_key=b"s" * 32, timeout_s=3))
    try:
        assert p.sender.call("receiver", b"me") == b"ok me"
        stranger.start()
        stranger.add_peer(p.receiver.info())
        with pytest.raises(TransferError):
            stranger.call("receiver", b"me too")
    finally:
        stranger.close()
        _close(p)


def test_the_lanes_of_threads_that_ended_are_closed():
    p = make_pair(on_call=lambda peer, request: b"ok")
    try:
        all_called = threading.Barrier(5)

        def call_then_wait():
            p.sender.call("receiver", b"x")
            all_called.wait(10)  # none ends before all opened theirs

        workers = [threading.Thread(target=call_then_wait) for _ in range(5)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(10)
        assert len(p.sender._lane_client._all) == 5
        p.sender.call("receiver", b"x")  # this thread opens its own: the ended threads' go
        assert len(p.sender._lane_client._all) == 1
    finally:
        _close(p)


@pytest.mark.parametrize("renamed", [False, True], ids=["same-name", "new-name"])
def test_a_restarted_peer_leaves_no_lane_behind(renamed):
    """Each restart of a peer (a new call port; a KV engine's name carries its pid, so a new name
    too) left this thread one more half-closed socket, for the life of the thread."""
    caller = TransferEngine("caller", EngineConfig(transports=("tcp",)))
    caller.start()
    try:
        for i in range(3):
            peer = TransferEngine(f"peer-{i}" if renamed else "peer", EngineConfig(transports=("tcp",)))
            caller.add_peer(peer.start(on_call=lambda who, request: b"ok"))
            try:
                assert caller.call(peer.name, b"x") == b"ok"
            finally:
                peer.close()
        assert len(caller._lane_client._all) == 1
    finally:
        caller.close()


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_malformed_reply_or_failing_cleanup_is_answered_and_the_lane_stays_in_step():
    def on_call(peer, request):
        if request == b"none":
            return None
        if request == b"cleanup":
            return CallReply(b"fine", [b"x"], done=lambda: 1 / 0)
        return b"ok " + request

    p = make_pair(on_call=on_call)
    try:
        assert p.sender.call("receiver", b"1") == b"ok 1"
        with pytest.raises(TransferError, match="failed the call"):
            p.sender.call("receiver", b"none")
        assert bytes(p.sender.call("receiver", b"cleanup")) == b"finex"
        assert p.sender.call("receiver", b"2") == b"ok 2"
        with p.receiver._lane_server._lock:
            assert len(p.receiver._lane_server._lanes) == 1  # the same lane all along
    finally:
        _close(p)


def test_an_attachment_of_more_buffers_than_one_syscall_takes():
    pieces = [bytes([i % 251]) * 7 for i in range(3000)]  # IOV_MAX is 1024
    p = make_pair(on_call=lambda peer, request: CallReply(b"h", pieces))
    try:
        landing = np.zeros((3000, 7), dtype=np.uint8)
        assert p.sender.call("receiver", b"q", into=lambda body, n: list(landing)) == b"h"
        assert landing.tobytes() == b"".join(pieces)
    finally:
        _close(p)


def test_an_idle_lane_closed_by_the_callee_is_redialled(monkeypatch):
    from messenger import call_lane

    monkeypatch.setattr(call_lane, "LANE_IDLE_S", 0.2)
    p = make_pair(on_call=lambda peer, request: b"got " + request)
    try:
        assert p.sender.call("receiver", b"1") == b"got 1"
        deadline = time.monotonic() + 5
        while p.receiver._lane_server._lanes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not p.receiver._lane_server._lanes  # the callee let it go
        assert p.sender.call("receiver", b"2") == b"got 2"
    finally:
        _close(p)


def test_a_reply_trickled_byte_by_byte_fails_the_call_by_its_deadline():
    # Each byte arrives well within the socket timeout, so a per-read timeout alone would wait
    # for all 4 KiB (about 40 s here); the call's deadline ends it after its 0.5 s.
    from messenger.call_lane import _REPLY, LaneClient, REPLY_MAGIC
    from messenger.stats import TransportStats

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)  # the request
            reply = _REPLY.pack(REPLY_MAGIC, 0, 4096, 0) + b"x" * 4096
            for i in range(len(reply)):
                if stop.is_set():
                    return
                try:
                    conn.sendall(reply[i:i + 1])
                except OSError:
                    return  # the caller gave up and closed its lane
                time.sleep(0.01)

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    stats = TransportStats()
    client = LaneClient(None, stats)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match="no reply within 0.5 s"):
            client.call("slow", f"127.0.0.1:{listener.getsockname()[1]}", (0, b"{}"), b"req", 0.5)
        # Its deadline and the slack, with a margin for a loaded machine; without a deadline the
        # trickle would take about 40 s.
        assert time.monotonic() - started < 0.5 * 1.05 + 1.0
    finally:
        stop.set()
        client.close()
        listener.close()
        server.join(timeout=5)


def test_a_hostile_request_length_or_a_caller_stalled_mid_call_frees_the_lane():
    """A head announcing a huge request is dropped before any allocation, and a caller that
    stops sending mid-request is let go after the engine's timeout (the lane's thread with it);
    a request over the bound is refused on the calling side with a clear error."""
    from messenger.call_lane import _REQUEST, MAX_REQUEST_BYTES, REQUEST_MAGIC

    p = make_pair(EngineConfig(transports=("tcp",), timeout_s=0.5), on_call=lambda peer, request: b"ok")
    try:
        host, _, port = p.receiver.info().call_address.rpartition(":")
        server = p.receiver._lane_server
        with socket.create_connection((host, int(port))) as huge:
            huge.sendall(_REQUEST.pack(REQUEST_MAGIC, 0, MAX_REQUEST_BYTES + 1))
            huge.settimeout(5)
            assert huge.recv(1) == b""  # dropped, nothing allocated
        with socket.create_connection((host, int(port))) as stalled:
            stalled.sendall(_REQUEST.pack(REQUEST_MAGIC, 0, 1000) + b"x" * 10)  # then nothing more
            stalled.settimeout(5)
            started = time.monotonic()
            assert stalled.recv(1) == b""  # the callee gave up on it
            assert time.monotonic() - started < 4
        deadline = time.monotonic() + 5
        while server._lanes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._lanes
        with pytest.raises(TransferError, match="over the"):
            p.sender.call("receiver", b"x" * (MAX_REQUEST_BYTES + 1))
        assert p.sender.call("receiver", b"fine") == b"ok"
    finally:
        _close(p)
