"""Call lanes: each calling thread keeps a plain blocking TCP connection per peer for its calls,
and the peer serves each lane on a thread of its own.

Why not the transports' links: there a call crossed four thread hand-offs (the request queued to
the link's sender, the callee's receiver handing it to a call pool, the reply's sender, the
caller's wake-up), and on two cores each cost tens of microseconds: an empty call took 213 us
(p50) where a Python socket ping-pong takes 18-32 us (RESULTS.md, "A call's round trip"). On a
lane a call is that ping-pong: the caller writes the request and reads the reply on the same
socket, and the callee's lane thread reads it, runs the handler and writes the reply, with no
hand-off on either side. A single remote get of a small pool block is one call (store/remote.py),
so its speed is this round trip.

Frames (all integers big-endian):

    request: "MCCL" | caller description length u32 (0: unchanged on this lane) | request length u64,
             then the caller's PeerInfo JSON (when sent) and the request
    reply:   "MCCR" | status u8 (0 ok, 1 the handler failed: the body is its error) | body length u64
             | attachment length u64, then the body and the attachment (messenger/api.py's
             CallReply: sent from the handler's buffers, received into the caller's)

A lane carries one call at a time, so nothing is multiplexed and a reply is the one the caller
waits for. A lane that timed out or broke is closed (it may still carry a late reply); a lane that
fails before any byte of the reply on its first use after an idle spell is redialled once,
because an idle connection may have been dropped by the peer's restart or a middlebox. The
handshake (messenger/handshake.py) runs on every lane when the engine has an auth key.
A call has one deadline, taken when it starts: opening its lane, a redial, and (in the engine) a
fallback to the transport all spend the same `timeout_s`, never a fresh one each.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from messenger.api import AttachmentSink, CallFailed, CallReply, TimedOut, TransferError
from messenger.handshake import client_handshake, server_handshake
from messenger.stats import TransportStats
from messenger.tcp_link import keep_alive, published_address, shutdown_socket
from messenger.wire import MAX_PAYLOAD_BYTES, MAX_VAR_BYTES, WireError, recv_exactly, recv_into_views, send_views

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("!4sIQ")
_REPLY = struct.Struct("!4sBQQ")
REQUEST_MAGIC, REPLY_MAGIC = b"MCCL", b"MCCR"
OK, FAILED = 0, 1
MAX_INFO_BYTES = 16 << 20
# A call's request is a message (the tcp transport's bound on one, wire.MAX_VAR_BYTES): its body
# is allocated whole before it is read, so a corrupt or hostile length must not reach gigabytes.
MAX_REQUEST_BYTES = MAX_VAR_BYTES
MAX_LANES = 4096  # lanes one engine serves at once; more are refused (a runaway or hostile client)
LANE_IDLE_S = 300.0  # a lane with no call for this long is closed (its caller redials when it needs one)
# A lane that cannot be opened (a firewall that drops, a peer whose lanes are off) costs at most
# this, and at most half of what is left of the call (the rest is for the transport it falls back
# to), once; then calls to that address go through the transport for a while.
CONNECT_TIMEOUT_S, UNREACHABLE_FOR_S = 3.0, 60.0
DEADLINE_SLACK = 0.05  # a call ends within (1 + this) x its timeout, however slowly its reply comes (_DeadlineSocket)

# The engine's handler: (the caller's latest PeerInfo JSON, the request) -> (status, CallReply).
Answer = Callable[[bytes, bytes], tuple[int, CallReply]]


class LaneUnreachable(TransferError):
    """No lane could be opened to the peer (refused, unroutable): the call may go another way."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a call is a small frame: never delay it


class LaneServer:
    """Listens for lanes and answers their calls, one thread per lane."""

    def __init__(self, host: str, port: int, auth_key: bytes | None, io_timeout_s: float,
                 answer: Answer, name: str, stats: TransportStats, advertise_host: str | None = None) -> None:
        self._host, self._port, self._auth_key = host, port, auth_key
        self._advertise_host = advertise_host
        self._io_timeout_s = io_timeout_s
        self._answer, self._name, self._stats = answer, name, stats
        self._listener: socket.socket | None = None
        self._lanes: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def start(self) -> str:
        """Listen; returns the address to publish ("host:port")."""
        self._listener = socket.create_server((self._host, self._port), backlog=128)
        threading.Thread(target=self._accept_loop, name=f"messenger-lanes-{self._name}", daemon=True).start()
        return published_address(self._listener, self._advertise_host)

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            shutdown_socket(self._listener)  # shutdown wakes the accept loop; a bare close would not
        with self._lock:
            lanes, self._lanes = list(self._lanes), set()
        for lane in lanes:
            shutdown_socket(lane)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                log.warning("messenger %s: accepting a call lane failed: %s", self._name, exc)
                time.sleep(0.1)  # out of descriptors, say: the listener stays, so keep serving it
                continue
            with self._lock:
                full = len(self._lanes) >= MAX_LANES
                if not full:
                    self._lanes.add(conn)
            if full:
                log.warning("messenger %s: refused a call lane, %d already open", self._name, MAX_LANES)
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name=f"messenger-lane-{self._name}",
                                 daemon=True).start()
            except RuntimeError as exc:  # no thread to be had
                log.warning("messenger %s: no thread for a call lane: %s", self._name, exc)
                with self._lock:
                    self._lanes.discard(conn)
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        caller = b""
        head = bytearray(_REQUEST.size)
        try:
            _tune(conn)
            keep_alive(conn)  # a caller's host that vanished
            if self._auth_key is not None:
                conn.settimeout(self._io_timeout_s)
                server_handshake(conn, self._auth_key)
            while not self._closed.is_set():
                conn.settimeout(LANE_IDLE_S)
                try:
                    recv_into_views(conn, [memoryview(head)])
                except (WireError, TimeoutError):
                    return  # the caller closed its lane between calls, or left it idle: the normal end
                # The rest of the call and its reply must make progress: a caller that froze or
                # vanished mid-call frees this thread (and the reply's done(), e.g. pool pins).
                conn.settimeout(self._io_timeout_s)
                magic, info_len, request_len = _REQUEST.unpack(head)
                if magic != REQUEST_MAGIC or info_len > MAX_INFO_BYTES or request_len > MAX_REQUEST_BYTES:
                    log.warning("messenger %s: dropped a call lane that sent a foreign frame", self._name)
                    return
                if info_len:
                    caller = bytes(recv_exactly(conn, info_len))
                request = bytes(recv_exactly(conn, request_len)) if request_len else b""
                frames, done = self._reply_frames(caller, request)
                try:
                    sent = send_views(conn, frames)
                    self._stats.moved(sent=sent, received=_REQUEST.size + info_len + request_len)
                finally:
                    self._sent(done)  # the attachment's buffers were read by the kernel: release them
        except OSError as exc:  # a reset, a failed handshake, or this side closing
            if not self._closed.is_set():
                log.debug("messenger %s: call lane ended: %s", self._name, exc)
        finally:
            with self._lock:
                self._lanes.discard(conn)
            conn.close()


    def _reply_frames(self, caller: bytes, request: bytes) -> tuple[list, Callable[[], None] | None]:
        """The handler's answer as the buffers to send, and what to run once they are sent.
        Whatever goes wrong becomes a FAILED reply, so the lane stays in step and its caller
        never sends the request again."""
        done = None
        try:
            status, reply = self._answer(caller, request)
            done = reply.done
            attached = [memoryview(v).cast("B") for v in reply.attachment]
            body = memoryview(reply.body).cast("B")
            head = _REPLY.pack(REPLY_MAGIC, status, body.nbytes, sum(v.nbytes for v in attached))
            return [head, body, *attached], done
        except Exception as exc:  # noqa: BLE001 - an undecodable caller, a malformed reply
            error = f"{type(exc).__name__}: {exc}".encode()
            return [_REPLY.pack(REPLY_MAGIC, FAILED, len(error), 0), error], done

    def _sent(self, done: Callable[[], None] | None) -> None:
        if done is not None:
            try:
                done()
            except Exception:  # noqa: BLE001 - the handler's cleanup; the lane goes on
                log.exception("messenger %s: a call reply's done() failed", self._name)


class _Lane:
    __slots__ = ("sock", "address", "info_version", "used")

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock, self.address, self.info_version, self.used = sock, address, -1, False


class LaneClient:
    """The calling side: one lane per (calling thread, peer), to the peer's current address,
    opened on first use."""

    def __init__(self, auth_key: bytes | None, stats: TransportStats) -> None:
        self._auth_key = auth_key
        self._stats = stats
        self._local = threading.local()
        self._all: dict[socket.socket, threading.Thread] = {}  # every open lane and the thread it serves
        self._lock = threading.Lock()
        self._closed = False
        self._unreachable: dict[str, float] = {}  # address -> until when calls skip it (monotonic)

    def call(self, peer: str, address: str, caller: tuple[int, bytes], request: bytes,
             timeout_s: float, into: AttachmentSink | None = None,
             deadline: float | None = None) -> bytes | bytearray:
        """One call on this thread's lane to `address`; returns the reply's body (followed by its
        attachment unless `into` took it). `caller` is (version, this engine's PeerInfo JSON):
        sent when the lane has not seen that version. `deadline` (time.monotonic()) ends the call,
        its connect and redial included; None: `timeout_s` from now (`timeout_s` is the call's
        whole timeout, as its errors say). Raises LaneUnreachable when no lane opens,
        TransferError when the call fails or times out; whatever `into` raises, after the lane
        is closed."""
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        if len(request) > MAX_REQUEST_BYTES:
            raise TransferError(f"call to {peer}: a request of {len(request)} B is over the "
                                f"{MAX_REQUEST_BYTES} B a call may carry (send bulk bytes as a write)")
        lanes: dict[str, _Lane] = self._local.__dict__.setdefault("lanes", {})  # by peer name
        lane = lanes.get(peer)
        if lane is not None and lane.address != address:
            # The peer restarted at another address: its old lane would stay open (its socket
            # half-closed) for the life of this thread, one more per restart.
            self._drop(lanes, peer, lane)
            lane = None
        if lane is None:
            self._drop_closed(lanes)
        if lane is None and self._unreachable.get(address, 0.0) > time.monotonic():
            raise LaneUnreachable(f"call to {peer}: its lanes at {address} were unreachable moments ago")
        for attempt in (0, 1):
            if lane is None:
                try:
                    lane = lanes[peer] = self._open(peer, address, timeout_s, deadline)
                except LaneUnreachable as exc:
                    if attempt:  # the request went out once: no other way may send it again
                        raise TransferError(f"call to {peer}: its lane broke and cannot be reopened: {exc}") from None
                    raise
            reused = lane.used
            started = time.perf_counter()
            try:
                status, body = self._exchange(peer, lane, caller, request, timeout_s, deadline, into)
            except _Stale:
                self._drop(lanes, peer, lane)
                lane = None
                if not reused or attempt:
                    raise TransferError(f"call to {peer}: the connection closed before a reply") from None
                continue
            except BaseException as exc:
                self._drop(lanes, peer, lane)
                self._stats.failed("timeout" if "no reply within" in str(exc) else "transfer")
                raise
            self._stats.request(time.perf_counter() - started)
            if status != OK:  # the handler's error, answered in order: the lane stays good
                raise CallFailed(f"{peer} failed the call: {body.decode(errors='replace')}")
            return body
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            lanes, self._all = list(self._all), {}
        for sock in lanes:
            shutdown_socket(sock)

    def _open(self, peer: str, address: str, timeout_s: float, deadline: float) -> _Lane:
        if self._closed:
            raise TransferError("the engine is closed")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimedOut(f"call to {peer} got no reply within {timeout_s} s")
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=min(left / 2, CONNECT_TIMEOUT_S))
        except OSError as exc:
            self._unreachable[address] = time.monotonic() + UNREACHABLE_FOR_S
            raise LaneUnreachable(f"call to {peer}: no lane to {address}: {exc}") from None
        try:
            _tune(sock)
            if self._auth_key is not None:
                client_handshake(_DeadlineSocket(sock, deadline, timeout_s), self._auth_key)
        except TimeoutError:
            sock.close()
            raise TimedOut(f"call to {peer} got no reply within {timeout_s} s") from None
        except OSError as exc:
            sock.close()
            raise TransferError(f"call to {peer}: {exc}") from None
        with self._lock:  # the lanes of threads that ended are closed here: nothing else would
            ended = [s for s, owner in self._all.items() if not owner.is_alive()]
            for s in ended:
                del self._all[s]
            self._all[sock] = threading.current_thread()
        for s in ended:
            s.close()
        return _Lane(sock, address)

    def _drop_closed(self, lanes: dict[str, _Lane]) -> None:
        """Close this thread's lanes whose callee has closed its end (a peer that exited): an idle
        lane has nothing to read, so a readable one is at its end. A restarted peer comes back
        under a new name (its pid is in it), and its old lanes would stay open for the life of
        this thread, one per restart. Runs only before a new lane is opened."""
        if not lanes:
            return
        poller = select.poll()
        by_fd = {}
        for peer, lane in lanes.items():
            poller.register(lane.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            by_fd[lane.sock.fileno()] = peer
        for fd, _ in poller.poll(0):
            peer = by_fd[fd]
            self._drop(lanes, peer, lanes[peer])

    def _drop(self, lanes: dict[str, _Lane], peer: str, lane: _Lane) -> None:
        if lanes.get(peer) is lane:
            del lanes[peer]
        with self._lock:
            self._all.pop(lane.sock, None)
        lane.sock.close()

    def _exchange(self, peer: str, lane: _Lane, caller: tuple[int, bytes], request: bytes,
                  timeout_s: float, deadline: float, into: AttachmentSink | None) -> tuple[int, bytes | bytearray]:
        version, info = caller
        if lane.info_version == version:
            info = b""
        try:
            sock = _DeadlineSocket(lane.sock, deadline, timeout_s)
            sent = send_views(sock, [_REQUEST.pack(REQUEST_MAGIC, len(info), len(request)), info, request])
            head = sock.recv(_REPLY.size)
        except TimeoutError:
            raise TimedOut(f"call to {peer} got no reply within {timeout_s} s") from None
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale() from None
        except OSError as exc:
            raise TransferError(f"call to {peer}: {exc}") from None
        if not head:
            raise _Stale()
        lane.used, lane.info_version = True, version
        with _reading(peer, timeout_s):
            if len(head) < _REPLY.size:
                head += recv_exactly(sock, _REPLY.size - len(head))
            magic, status, length, attached = _REPLY.unpack(head)
            if magic != REPLY_MAGIC or length > MAX_PAYLOAD_BYTES or attached > MAX_PAYLOAD_BYTES:
                raise WireError("the reply is not a call reply")
            body = recv_exactly(sock, length) if length else bytearray()  # not copied once more
            if attached and into is None:
                body += recv_exactly(sock, attached)
        if attached and into is not None:
            views = [memoryview(v).cast("B") for v in into(body, attached)]  # its errors are the caller's
            if sum(v.nbytes for v in views) != attached:
                raise TransferError(f"call to {peer}: the buffers for the reply's {attached} B "
                                    f"hold {sum(v.nbytes for v in views)} B")
            with _reading(peer, timeout_s):
                recv_into_views(sock, views)
        self._stats.moved(sent=sent, received=_REPLY.size + length + attached)
        return status, body


class _DeadlineSocket:
    """A lane's socket for one call, whose reads and writes all end by the call's deadline. A
    socket timeout alone bounds each operation, not the call: a peer trickling its reply a few
    bytes at a time would hold the caller for as long as it likes. The timeout is tightened to
    what is left only once it overshoots that by DEADLINE_SLACK of the call's timeout, so a call
    ends within 1 + DEADLINE_SLACK of its timeout, and a fast call, done long before that, pays
    one clock read per operation and no extra syscall."""

    __slots__ = ("_sock", "_deadline", "_timeout", "_slack")

    def __init__(self, sock: socket.socket, deadline: float, timeout_s: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        self._sock, self._deadline, self._timeout = sock, deadline, left
        self._slack = timeout_s * DEADLINE_SLACK
        sock.settimeout(left)

    def _tighten(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        if self._timeout - left > self._slack:
            self._timeout = left
            self._sock.settimeout(left)

    def recv(self, n: int) -> bytes:
        self._tighten()
        return self._sock.recv(n)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        self._tighten()
        return self._sock.recv_into(buffer, nbytes)

    def recvmsg_into(self, buffers) -> tuple:
        self._tighten()
        return self._sock.recvmsg_into(buffers)

    def sendall(self, data) -> None:
        self._tighten()
        self._sock.sendall(data)

    def sendmsg(self, buffers) -> int:
        self._tighten()
        return self._sock.sendmsg(buffers)


@contextmanager
def _reading(peer: str, timeout_s: float):
    """A failure while reading a reply, as the caller's TransferError."""
    try:
        yield
    except TimeoutError:
        raise TimedOut(f"call to {peer} got no reply within {timeout_s} s") from None
    except OSError as exc:
        raise TransferError(f"call to {peer}: the connection broke mid-reply: {exc}") from None


class _Stale(Exception):
    """The lane broke before any byte of the reply: the request may be sent again on a new one."""
