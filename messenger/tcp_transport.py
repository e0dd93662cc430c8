"""The transfer engine's tcp transport: several pipelined streams per peer, zero-copy both ways.

Sending: a batch's slices are coalesced (neighbours on both sides become one), cut into frames of
a few MiB (a large slice spans frames) and dealt round-robin to the peer's `tcp_streams`
connections, each drained by its own sender thread; frames go back to back, never one round trip
per slice. A frame is sent with sendmsg straight from the registered region's memoryview. One
BATCH frame per batch (the slice list and the message) goes first, so a receiver whose sender dies
mid-batch can hand the message's owner the error at once; a SUMS frame with the checksums follows
the data on one stream (hashing overlaps the sending).

Receiving: each connection's reader thread checks a DATA frame's segments against the regions
BEFORE reading, then recv_into's the bytes straight into them (scatter with recvmsg_into); a bad
segment is read into a scratch buffer and fails the batch, never writes outside a region. The
receiver counts frames per (sender session, batch) across all streams; when all landed and the
BATCH and SUMS frames came, it calls the engine's `slices_landed` and acks (with the error, if any) on that
connection. The sender completes the Batch on the ack.

READ: the client sends READ frames (which chunks it wants, where they go is kept on this side);
the server answers each with READ_DATA straight from its region; the client scatters each into
the destination views, each frame as a landing of the batch (Batch.begin_landing): a frame of a
batch that ended is drained instead, and one already landing delays the batch's end (its timeout,
a READ_ERR on another stream) until it is in, bounded by the socket's timeout.

Failures: a connection that errs or closes fails every batch in flight on its link at once (all
of the link's streams are closed; the next batch reconnects); a peer silent for `timeout_s`
while something is pending is dropped the same way (the engine's watchdog bounds it too). A
WRITE batch that ends without its ACK (it timed out) sends no more of its frames and an ABORT
frame: the receiver forgets it, fails its message, and ignores its frames still on the way, so
the two sides agree that it failed. Accepted connections use TCP keepalive: a sender whose host
vanished releases its reader thread.
Threads, not asyncio: callers are vLLM's synchronous threads and socket I/O releases the GIL.
The sending side (links, streams, frame planning) is messenger/tcp_link.py; this module is the
transport itself and its receiving side.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Slice, TransferError
from messenger.handshake import HandshakeError, server_handshake
from messenger.stats import TransportStats
from messenger.tcp_link import Link, drain, keep_alive, published_address, send_frame, shutdown_socket, tune_socket
from messenger.wire import ENGINE_PREFIX_SIZE, Kind, WireError, decode_engine_prefix, recv_exactly, recv_into_views

log = logging.getLogger(__name__)

_decode = msgspec.msgpack.decode
_ABORTED_KEPT = 4096  # aborted batches remembered, to ignore their late frames


@dataclass
class _Inbound:
    """A WRITE batch arriving from one sender session, across all of its streams."""

    landed: int = 0
    expected: int = -1  # known once the BATCH frame came
    checksums: tuple[int, ...] | None = None  # known once the SUMS frame came
    slices: list[Slice] | None = None
    message: OutgoingMessage | None = None
    error: str | None = None


class TcpTransport:
    name = "tcp"

    def __init__(self, config) -> None:  # config: messenger.engine.EngineConfig
        self._config = config
        self.stats_counter = TransportStats()
        self._links: dict[str, Link] = {}
        self._links_lock = threading.Lock()
        self._inbound: dict[tuple[int, int], _Inbound] = {}
        self._aborted: OrderedDict[tuple[int, int], None] = OrderedDict()  # (session, batch): its sender gave up
        self._inbound_lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self.regions = None
        self.deliver = None
        self.local_name = ""

    # --- the Transport protocol ----------------------------------------------------------------

    def available(self) -> str | None:
        return None

    def start(self, regions, deliver) -> str:
        self.regions, self.deliver = regions, deliver
        self.local_name = getattr(deliver, "name", "")
        self._listener = socket.create_server((self._config.host, self._config.port), backlog=128)
        threading.Thread(target=self._accept_loop, name="messenger-tcp-accept", daemon=True).start()
        return published_address(self._listener, self._config.advertise_host)

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        return self.name in peer.transports

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        link = self._link(peer)
        if direction is Direction.WRITE:
            link.write(slices, batch, message)
        else:
            link.read(slices, batch)

    def unregister(self, name: str) -> None:
        """Nothing to release: regions are looked up by name for every batch."""

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        self._link(peer).message(payload, batch)

    def stats(self) -> dict:
        return self.stats_counter.snapshot()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            shutdown_socket(self._listener)  # shutdown wakes the accept loop; a bare close would not
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.fail(TransferError("the tcp transport closed"))
        for conn in list(self._conns):
            shutdown_socket(conn)

    # --- outbound ------------------------------------------------------------------------------

    def _link(self, peer: PeerInfo) -> "Link":
        if self._closed.is_set():
            raise TransferError("the tcp transport is closed")
        address = peer.transports.get(self.name)
        if address is None:
            raise TransferError(f"peer {peer.name!r} has no tcp address")
        with self._links_lock:
            link = self._links.get(address)
            if link is None or link.failed is not None:
                link = self._links[address] = Link(self, peer.name, address)
            return link

    def _forget(self, link: "Link") -> None:
        with self._links_lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    # --- inbound -------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            tune_socket(conn)
            keep_alive(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name="messenger-tcp-in", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        self._conns.add(conn)
        session, peer = None, f"{addr}"
        try:
            if self._config.auth_key is not None:
                conn.settimeout(self._config.timeout_s)
                server_handshake(conn, self._config.auth_key)
                conn.settimeout(None)
            prefix = bytearray(ENGINE_PREFIX_SIZE)
            kind, var, session, _, _ = self._recv_frame(conn, prefix)
            if kind != Kind.HELLO:
                raise WireError(f"expected HELLO, got frame kind {kind}")
            peer = _decode(var)[0]
            while not self._closed.is_set():
                kind, var, batch_id, arg, payload_len = self._recv_frame(conn, prefix)
                if kind == Kind.DATA:
                    self._on_data(conn, session, peer, batch_id, var, payload_len)
                elif kind == Kind.BATCH:
                    slices, payload = _decode(var)
                    state = self._state(session, batch_id)
                    if state is not None:
                        state.slices = [Slice(*s) for s in slices]
                        state.message = OutgoingMessage(payload) if payload is not None else None
                        self._landed(conn, session, peer, batch_id, expected=arg)
                elif kind == Kind.SUMS:
                    self._landed(conn, session, peer, batch_id, checksums=tuple(_decode(var)))
                elif kind == Kind.ABORT:
                    self._abort(session, peer, batch_id)
                elif kind == Kind.READ:
                    self._serve_read(conn, batch_id, var)
                elif kind == Kind.MSG:
                    error = ""
                    try:
                        self.deliver.message(peer, var)
                    except Exception as exc:  # the sender learns it from the ack
                        log.exception("message from %s failed", peer)
                        error = f"{type(exc).__name__}: {exc}"
                    self._send(conn, Kind.ACK, batch_id, 0, error.encode())
                else:
                    raise WireError(f"unexpected frame kind {kind} from a client")
        except HandshakeError as exc:
            log.warning("refused a messenger connection from %s: %s", addr, exc)
        except (OSError, ValueError, msgspec.DecodeError) as exc:  # WireError is an OSError
            if not self._closed.is_set():
                log.debug("messenger connection from %s ended: %s", peer, exc)
        finally:
            self._conns.discard(conn)
            shutdown_socket(conn)
            if session is not None:
                self._drop_session(session, peer)

    def _recv_frame(self, conn: socket.socket, prefix: bytearray):
        recv_into_views(conn, [memoryview(prefix)])
        kind, var_len, batch_id, arg, payload_len = decode_engine_prefix(prefix)
        var = bytes(recv_exactly(conn, var_len)) if var_len else b""
        self.stats_counter.moved(received=ENGINE_PREFIX_SIZE + var_len + (payload_len if kind != Kind.DATA else 0))
        return kind, var, batch_id, arg, payload_len

    def _send(self, conn: socket.socket, kind: int, batch_id: int, arg: int, var: bytes, views=()) -> None:
        send_frame(self.stats_counter, conn, kind, batch_id, arg, var, views)

    def _on_data(self, conn, session: int, peer: str, batch_id: int, var: bytes, payload_len: int) -> None:
        with self._inbound_lock:
            aborted = (session, batch_id) in self._aborted
        if aborted:  # the sender gave up on it: its bytes must not land
            drain(conn, payload_len)
            self.stats_counter.moved(received=payload_len)
            return
        error, views = None, []
        try:
            for region_name, offset, length in _decode(var):
                region = self.regions.get(region_name)
                region.check(offset, length)
                if region.view is None:
                    raise TransferError(f"region {region_name!r} is device memory: tcp cannot reach it")
                views.append(region.view[offset:offset + length])
            if sum(v.nbytes for v in views) != payload_len:
                raise TransferError("a DATA frame's segments do not add up to its payload")
        except TransferError as exc:
            error = str(exc)
        if error is None:
            recv_into_views(conn, views)
        else:
            drain(conn, payload_len)
        self.stats_counter.moved(received=payload_len)
        self._landed(conn, session, peer, batch_id, error=error)

    def _state(self, session: int, batch_id: int) -> _Inbound | None:
        """The batch's state (None: its sender aborted it)."""
        with self._inbound_lock:
            if (session, batch_id) in self._aborted:
                return None
            return self._inbound.setdefault((session, batch_id), _Inbound())

    def _abort(self, session: int, peer: str, batch_id: int) -> None:
        """The sender gave up on a WRITE batch: forget it, tell the message's owner, and ignore
        whatever of it is still on the way (on any stream)."""
        key = (session, batch_id)
        with self._inbound_lock:
            state = self._inbound.pop(key, None)
            self._aborted[key] = None
            while len(self._aborted) > _ABORTED_KEPT:
                self._aborted.popitem(last=False)
        failed = getattr(self.deliver, "batch_failed", None)
        if state is not None and state.message is not None and failed is not None:
            failed(peer, state.message, f"{peer} gave up on the batch before it landed (timed out)")

    def _landed(self, conn, session: int, peer: str, batch_id: int, expected: int | None = None,
                checksums: tuple[int, ...] | None = None, error: str | None = None) -> None:
        """Count one DATA frame, or take the BATCH frame's count or the SUMS frame's checksums;
        finish the batch when all of them came."""
        key = (session, batch_id)
        with self._inbound_lock:
            if key in self._aborted:
                return
            state = self._inbound.setdefault(key, _Inbound())
            if expected is not None:
                state.expected = expected
            elif checksums is not None:
                state.checksums = checksums
            else:
                state.landed += 1
            if error is not None and state.error is None:
                state.error = error
            if state.landed != state.expected or state.checksums is None:
                return
            del self._inbound[key]
        if state.message is not None:
            state.message = OutgoingMessage(state.message.payload, state.checksums)
        if state.error is not None:
            failed = getattr(self.deliver, "batch_failed", None)
            if failed is not None:
                failed(peer, state.message, state.error)
            result = state.error
        else:
            result = self.deliver.slices_landed(peer, state.slices, state.message)
        self._send(conn, Kind.ACK, batch_id, 0, (result or "").encode())

    def _drop_session(self, session: int, peer: str) -> None:
        with self._inbound_lock:
            lost = [(k, s) for k, s in self._inbound.items() if k[0] == session]
            for k, _ in lost:
                del self._inbound[k]
            for k in [k for k in self._aborted if k[0] == session]:
                del self._aborted[k]
        failed = getattr(self.deliver, "batch_failed", None)
        for _, state in lost:
            if state.message is not None and failed is not None:
                failed(peer, state.message, f"the connection from {peer} closed before the batch landed")

    def _serve_read(self, conn: socket.socket, batch_id: int, var: bytes) -> None:
        for index, segments in _decode(var):
            try:
                views = []
                for region_name, offset, length in segments:
                    region = self.regions.get(region_name)
                    region.check(offset, length)
                    if region.view is None:
                        raise TransferError(f"region {region_name!r} is device memory: tcp cannot reach it")
                    views.append(region.view[offset:offset + length])
            except TransferError as exc:
                self._send(conn, Kind.READ_ERR, batch_id, index, str(exc).encode())
                return
            self._send(conn, Kind.READ_DATA, batch_id, index, b"", views)
