"""TCP transport: a threaded request/reply server and a client with one persistent connection per
peer.

Every request frame gets exactly one reply frame, so a sender knows its bytes landed (and passed
the receiver's checksum) before it reports a transfer done. Threads, not asyncio: the callers are
vLLM's worker threads, which are synchronous, and socket I/O releases the GIL.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from messenger.handshake import HandshakeError, client_handshake, server_handshake
from messenger.stats import TransportStats
from messenger.wire import WireError, recv_frame, send_frame

log = logging.getLogger(__name__)

# handler(header, payload) -> reply header. Exceptions become {"ok": False, "error": ...}.
Handler = Callable[[dict[str, Any], bytearray], dict[str, Any]]


class TransferError(ConnectionError):
    """A transfer did not complete: the peer is unreachable, closed, or refused the data."""


@dataclass(frozen=True)
class TcpConfig:
    """Socket settings shared by the client and the server."""

    connect_timeout_s: float = 5.0
    """How long to wait for a peer to accept a connection."""
    io_timeout_s: float = 60.0
    """How long one send or one reply may take before the transfer is declared failed."""
    auth_key: bytes | None = field(default=None, repr=False)
    """Shared key every connection must prove (messenger/handshake.py) before any frame is read;
    a server refuses, and a client will not talk to, a peer without it. None: no handshake."""

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0 or self.io_timeout_s <= 0:
            raise ValueError("TcpConfig timeouts must be positive")
        if self.auth_key is not None and len(self.auth_key) < 16:
            raise ValueError("TcpConfig.auth_key must be at least 16 bytes")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Large buffers let one sendall of a multi-megabyte layer proceed without many wakeups.
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        except OSError:
            pass


class TcpServer:
    """Accepts connections on HOST:PORT and answers each frame with `handler`'s reply."""

    def __init__(self, host: str, port: int, handler: Handler, config: TcpConfig = TcpConfig(),
                 stats: TransportStats | None = None):
        self._handler = handler
        self._config = config
        self.stats = stats or TransportStats()
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)

    @property
    def address(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def start(self) -> "TcpServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            _tune(conn)
            threading.Thread(
                target=self._serve, args=(conn, peer), name="kv-tcp-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            if self._config.auth_key is not None and not self._authenticate(conn, peer):
                return
            while not self._closed.is_set():
                try:
                    header, payload, size = recv_frame(conn)
                except (WireError, OSError) as exc:
                    if not isinstance(exc, WireError) or "after 0 of" not in str(exc):
                        log.debug("connection from %s ended: %s", peer, exc)
                    return
                self.stats.moved(received=size)
                try:
                    reply = self._handler(header, payload)
                except Exception as exc:  # the peer must get an answer, never a hang
                    log.exception("handler failed for %s", header.get("op"))
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    self.stats.moved(sent=send_frame(conn, reply))
                except OSError:
                    return

    def _authenticate(self, conn: socket.socket, peer: Any) -> bool:
        """The handshake, bounded in time: a silent stranger cannot hold a thread."""
        assert self._config.auth_key is not None
        conn.settimeout(self._config.connect_timeout_s)
        try:
            server_handshake(conn, self._config.auth_key)
        except (OSError, HandshakeError) as exc:  # WireError is an OSError
            log.warning("refused a KV connection from %s: %s", peer, exc)
            return False
        conn.settimeout(None)  # an idle pooled connection may wait for its next frame indefinitely
        return True


class TcpClient:
    """Sends frames to peers and waits for their reply. Thread-safe; one connection per peer."""

    def __init__(self, config: TcpConfig = TcpConfig(), stats: TransportStats | None = None):
        self._config = config
        self.stats = stats or TransportStats()
        self._conns: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def request(self, address: str, header: dict[str, Any], payload: Any = b"") -> dict[str, Any]:
        """Send one frame to `address` and return the reply header.

        Retries once on a fresh connection if a pooled connection turned out to be dead (the peer
        restarted). Raises TransferError when the peer cannot be reached or answers not ok.
        """
        with self._guard:
            lock = self._locks.setdefault(address, threading.Lock())
        with lock:
            for attempt in (1, 2):
                sock = self._conns.get(address)
                fresh = sock is None
                try:
                    if sock is None:
                        sock = self._connect(address)
                        self._conns[address] = sock
                    started = time.perf_counter()
                    sent = send_frame(sock, header, payload)
                    reply, _, received = recv_frame(sock)
                    self.stats.request(time.perf_counter() - started)
                    self.stats.moved(sent=sent, received=received)
                    break
                except (OSError, WireError) as exc:
                    self._drop(address)
                    if fresh or attempt == 2:
                        raise TransferError(f"transfer to {address} failed: {exc}") from exc
        if not reply.get("ok", False):
            raise TransferError(f"{address} refused {header.get('op')}: {reply.get('error')}")
        return reply

    def _connect(self, address: str) -> socket.socket:
        sock = socket.create_connection(parse_address(address), timeout=self._config.connect_timeout_s)
        sock.settimeout(self._config.io_timeout_s)
        _tune(sock)
        if self._config.auth_key is not None:
            try:
                client_handshake(sock, self._config.auth_key)
            except BaseException:
                sock.close()
                raise
        return sock

    def _drop(self, address: str) -> None:
        sock = self._conns.pop(address, None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        for address in list(self._conns):
            self._drop(address)
