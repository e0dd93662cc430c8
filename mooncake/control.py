"""The control channel between a worker's HTTP shell and its KV connector.

The connector lives in a vLLM worker process that the shell did not create and cannot call
directly; the shell asks it for counters and tells it to drop KV nobody will claim. Those calls
ride this channel, never the KV data socket, so a slow or saturated transfer cannot delay them
and a KV peer cannot issue them.

Built on `multiprocessing.connection` (standard library): a local AF_UNIX listener with an
HMAC handshake on a per-worker key, so only the shell that started the engine can talk to it.
Messages are JSON objects, one request and one reply per connection, each answered on its own thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge
from typing import Any

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]

LISTEN_BACKLOG = 64
HANDSHAKE_TIMEOUT_S = 5.0


def listen(endpoint: "ControlEndpoint") -> Listener:
    """A local listener whose accept() authenticates nothing: each connection's own thread runs
    the HMAC handshake (`handshake`). multiprocessing's Listener ran it inside accept(), one at a
    time on the accept thread, with a backlog of 1: a caller that gave up mid-handshake (a
    timeout) made accept() raise BrokenPipeError, which the loops took for a closed listener, and
    they ended; no connection was taken after."""
    return Listener(endpoint.path, family="AF_UNIX", backlog=LISTEN_BACKLOG)


def close_listener(listener: Listener) -> None:
    """Close a `listen` listener and wake the thread blocked in its accept(): closing the socket
    alone leaves that thread waiting in the kernel for good (one per closed service)."""
    sock = getattr(getattr(listener, "_listener", None), "_socket", None)  # multiprocessing's SocketListener
    with contextlib.suppress(OSError):  # not connected, or closed already: nothing to wake
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        listener.close()


def handshake(conn: Connection, endpoint: "ControlEndpoint", timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bool:
    """The server's half of multiprocessing's HMAC handshake on `conn`, bounded by `timeout_s`;
    False (logged) if the caller failed it, left, or said nothing in time."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket: its options are conn's
    try:
        _io_limit(sock, timeout_s)
        deliver_challenge(conn, endpoint.authkey)
        answer_challenge(conn, endpoint.authkey)
        _io_limit(sock, None)  # then calls wait as long as they need
        return True
    except (OSError, EOFError, AuthenticationError) as exc:
        log.warning("refused a connection on %s: %s: %s", endpoint.path, type(exc).__name__, exc)
        return False
    finally:
        sock.close()


def accept_forever(listener: Listener, closed: threading.Event, serve: Callable[[Connection], None],
                   name: str) -> None:
    """Accept connections until `closed`, each served (handshake first) on a daemon thread."""
    while not closed.is_set():
        try:
            conn = listener.accept()
        except OSError as exc:
            if closed.is_set():
                return
            log.warning("accepting on %s failed: %s; going on", listener.address, exc)  # EMFILE, say
            closed.wait(0.1)
            continue
        threading.Thread(target=serve, args=(conn,), name=name, daemon=True).start()


class ControlError(ConnectionError):
    """The connector did not answer: not started yet, gone, or too slow."""


@dataclass(frozen=True)
class ControlEndpoint:
    """Where a connector listens for control calls, and the key that authenticates them."""

    path: str
    authkey_hex: str

    @classmethod
    def new(cls) -> "ControlEndpoint":
        directory = tempfile.mkdtemp(prefix="mooncake-control-")
        return cls(os.path.join(directory, "connector.sock"), secrets.token_hex(16))

    @property
    def authkey(self) -> bytes:
        return bytes.fromhex(self.authkey_hex)


@dataclass
class ControlServer:
    """Answers each control request with `handler`'s reply, on a daemon thread."""

    endpoint: ControlEndpoint
    handler: Handler
    _listener: Listener | None = field(default=None, init=False)
    _closed: threading.Event = field(default_factory=threading.Event, init=False)

    def start(self) -> "ControlServer":
        if os.path.exists(self.endpoint.path):  # left by an engine that died
            os.unlink(self.endpoint.path)
        self._listener = listen(self.endpoint)
        # One thread per call: a push_outcome call waits for acknowledgements, and must not hold
        # up the stats scrapes or the other requests' calls behind it.
        threading.Thread(target=accept_forever, args=(self._listener, self._closed, self._answer_and_close,
                                                      "kv-control-call"), name="kv-control", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            close_listener(self._listener)

    def _answer_and_close(self, conn: Connection) -> None:
        with conn:
            if handshake(conn, self.endpoint):
                self._answer(conn)

    def _answer(self, conn: Connection) -> None:
        try:
            request = json.loads(conn.recv_bytes(1 << 20))
            reply = self.handler(request) if isinstance(request, dict) else {"ok": False, "error": "not an object"}
        except Exception as exc:  # noqa: BLE001 - the caller must get an answer, never a hang
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.send_bytes(json.dumps(reply).encode())
        except OSError:
            pass


def connect(endpoint: ControlEndpoint, timeout_s: float) -> Connection:
    """multiprocessing's Client(endpoint.path, authkey=endpoint.authkey), but no read or write on
    the connection (the HMAC handshake included) waits more than `timeout_s`: it raises OSError
    (TimeoutError for the connect and the handshake); callers wait for answers with poll. A
    listener whose process is frozen still completes connect() into its backlog, and Client then
    waits for the challenge for ever, on the calling thread: vLLM's scheduler, for the pool.

    Used for the pool's long-lived connections. control_call keeps Client: bounding it was taken
    back (stop 35) while the listener still ran handshakes one at a time, and has not been tried
    since the listener runs each on its connection's thread (`listen`)."""
    # Blocking, under the kernel's limits (a call past one fails with EAGAIN): Connection reads
    # the descriptor itself, and a unix connect() waits for room in a full backlog (a socket
    # timeout would make it fail at once instead).
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _io_limit(sock, timeout_s)
        sock.connect(endpoint.path)
        conn = Connection(sock.detach())
    except BlockingIOError:
        sock.close()
        raise TimeoutError(f"{endpoint.path} took no connection within {timeout_s} s") from None
    except BaseException:
        sock.close()
        raise
    try:
        answer_challenge(conn, endpoint.authkey)
        deliver_challenge(conn, endpoint.authkey)
    except BlockingIOError:
        conn.close()
        raise TimeoutError(f"{endpoint.path} answered no handshake within {timeout_s} s (its process is frozen?)") \
            from None
    except BaseException:
        conn.close()
        raise
    return conn


def _io_limit(sock: socket.socket, seconds: float | None) -> None:
    """Kernel send and receive timeouts of a blocking socket (None: none)."""
    seconds = 0.0 if seconds is None else max(seconds, 0.001)  # 0 means none
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def control_call(endpoint: ControlEndpoint, request: dict[str, Any], timeout_s: float = 2.0) -> dict[str, Any]:
    """One request and its reply. Raises ControlError if the connector does not answer in time."""
    try:
        with Client(endpoint.path, family="AF_UNIX", authkey=endpoint.authkey) as conn:
            conn.send_bytes(json.dumps(request).encode())
            if not conn.poll(timeout_s):
                raise ControlError(f"the connector did not answer {request.get('op')!r} within {timeout_s} s")
            return json.loads(conn.recv_bytes(1 << 20))
    except (OSError, EOFError, ValueError, AuthenticationError) as exc:
        raise ControlError(f"control call {request.get('op')!r} failed: {type(exc).__name__}: {exc}") from exc
