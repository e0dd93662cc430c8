"""The transfer engine's tcp transport: several pipelined streams per peer, zero-copy both ways.

Sending: a batch's slices are coalesced (neighbours on both sides become one), cut into frames of
a few MiB (a large slice spans frames) and dealt round-robin to the peer's `tcp_streams`
connections, each drained by its own sender thread; frames go back to back, never one round trip
per slice. A frame is sent with sendmsg straight from the registered region's memoryview. One
BATCH frame per batch (the slice list, the message, the checksums) follows the data on one stream.

Receiving: each connection's reader thread checks a DATA frame's segments against the regions
BEFORE reading, then recv_into's the bytes straight into them (scatter with recvmsg_into); a bad
segment is read into a scratch buffer and fails the batch, never writes outside a region. The
receiver counts frames per (sender session, batch) across all streams; when all landed and the
BATCH frame came, it calls the engine's `slices_landed` and acks (with the error, if any) on that
connection. The sender completes the Batch on the ack.

READ: the client sends READ frames (which chunks it wants, where they go is kept on this side);
the server answers each with READ_DATA straight from its region; the client scatters each into
the destination views.

Failures: a connection that errs or closes fails every batch in flight on its link at once (all
of the link's streams are closed; the next batch reconnects); a peer silent for `timeout_s`
while something is pending is dropped the same way (the engine's watchdog bounds it too).
Threads, not asyncio: callers are vLLM's synchronous threads and socket I/O releases the GIL.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

import msgspec

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Slice, TransferError
from messenger.handshake import HandshakeError, client_handshake, server_handshake
from messenger.stats import TransportStats
from messenger.wire import (ENGINE_PREFIX_SIZE, Kind, WireError, decode_engine_prefix, encode_engine_prefix,
                            recv_exactly, recv_into_views, send_views)

log = logging.getLogger(__name__)

MAX_FRAME_BYTES = 4 << 20  # a larger slice spans frames, so several streams share it
MIN_FRAME_BYTES = 256 << 10  # smaller neighbours share a frame (one header, one syscall)
MAX_FRAME_SEGMENTS = 256  # below IOV_MAX (1024) for sendmsg / recvmsg_into
SOCKET_BUFFER_BYTES = 8 << 20
_SCRATCH_BYTES = 1 << 20
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode

# (local region, local offset, remote region, remote offset, length)
Segment = tuple[str, int, str, int, int]


def plan_frames(slices: list[Slice], streams: int) -> list[list[Segment]]:
    """Cut a batch into frames of roughly equal size: coalesce neighbours, split large slices.
    Frames are sized so that every stream gets work (total / streams), within [MIN, MAX]."""
    merged: list[list] = []
    for s in slices:
        last = merged[-1] if merged else None
        if (last is not None and last[0] == s.local_region and last[1] + last[4] == s.local_offset
                and last[2] == s.remote_region and last[3] + last[4] == s.remote_offset):
            last[4] += s.length
        else:
            merged.append([s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length])
    total = sum(m[4] for m in merged)
    target = min(MAX_FRAME_BYTES, max(MIN_FRAME_BYTES, -(-total // streams)))
    frames: list[list[Segment]] = []
    current: list[Segment] = []
    room = target
    for lreg, loff, rreg, roff, length in merged:
        while length:
            take = min(length, room)
            current.append((lreg, loff, rreg, roff, take))
            loff, roff, length, room = loff + take, roff + take, length - take, room - take
            if room == 0 or len(current) == MAX_FRAME_SEGMENTS:
                frames.append(current)
                current, room = [], target
    if current:
        frames.append(current)
    return frames


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def _drain(sock: socket.socket, n: int) -> None:
    """Read and drop `n` bytes (a refused segment's), keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, _SCRATCH_BYTES)))
    while n:
        n -= recv_into_views(sock, [scratch[:min(n, scratch.nbytes)]])


@dataclass
class _Inbound:
    """A WRITE batch arriving from one sender session, across all of its streams."""

    landed: int = 0
    expected: int = -1  # known once the BATCH frame came
    slices: list[Slice] | None = None
    message: OutgoingMessage | None = None
    error: str | None = None


@dataclass
class _Read:
    batch: Batch
    frames: list[list[memoryview]]
    remaining: int


class TcpTransport:
    name = "tcp"

    def __init__(self, config) -> None:  # config: messenger.engine.EngineConfig
        self._config = config
        self.stats_counter = TransportStats()
        self._links: dict[str, _Link] = {}
        self._links_lock = threading.Lock()
        self._inbound: dict[tuple[int, int], _Inbound] = {}
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
        host, port = self._listener.getsockname()[:2]
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"{host}:{port}"

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        return self.name in peer.transports

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        link = self._link(peer)
        if direction is Direction.WRITE:
            link.write(slices, batch, message)
        else:
            link.read(slices, batch)

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        self._link(peer).message(payload, batch)

    def stats(self) -> dict:
        return self.stats_counter.snapshot()

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.fail(TransferError("the tcp transport closed"))
        for conn in list(self._conns):
            _shutdown(conn)

    # --- outbound ------------------------------------------------------------------------------

    def _link(self, peer: PeerInfo) -> "_Link":
        if self._closed.is_set():
            raise TransferError("the tcp transport is closed")
        address = peer.transports.get(self.name)
        if address is None:
            raise TransferError(f"peer {peer.name!r} has no tcp address")
        with self._links_lock:
            link = self._links.get(address)
            if link is None or link.failed is not None:
                link = self._links[address] = _Link(self, peer.name, address)
            return link

    def _forget(self, link: "_Link") -> None:
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
            _tune(conn)
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
                    slices, payload, checksums = _decode(var)
                    state = self._state(session, batch_id)
                    state.slices = [Slice(*s) for s in slices]
                    state.message = OutgoingMessage(payload, tuple(checksums)) if payload is not None else None
                    self._landed(conn, session, peer, batch_id, expected=arg)
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
            _shutdown(conn)
            if session is not None:
                self._drop_session(session, peer)

    def _recv_frame(self, conn: socket.socket, prefix: bytearray):
        recv_into_views(conn, [memoryview(prefix)])
        kind, var_len, batch_id, arg, payload_len = decode_engine_prefix(prefix)
        var = bytes(recv_exactly(conn, var_len)) if var_len else b""
        self.stats_counter.moved(received=ENGINE_PREFIX_SIZE + var_len + (payload_len if kind != Kind.DATA else 0))
        return kind, var, batch_id, arg, payload_len

    def _send(self, conn: socket.socket, kind: int, batch_id: int, arg: int, var: bytes, views=()) -> None:
        payload = sum(memoryview(v).nbytes for v in views)
        sent = send_views(conn, [encode_engine_prefix(kind, batch_id, arg, var, payload), *views])
        self.stats_counter.moved(sent=sent)

    def _on_data(self, conn, session: int, peer: str, batch_id: int, var: bytes, payload_len: int) -> None:
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
            _drain(conn, payload_len)
        self.stats_counter.moved(received=payload_len)
        self._landed(conn, session, peer, batch_id, error=error)

    def _state(self, session: int, batch_id: int) -> _Inbound:
        with self._inbound_lock:
            return self._inbound.setdefault((session, batch_id), _Inbound())

    def _landed(self, conn, session: int, peer: str, batch_id: int, expected: int | None = None,
                error: str | None = None) -> None:
        """Count one DATA frame (or take the BATCH frame's count); finish the batch when all landed."""
        key = (session, batch_id)
        with self._inbound_lock:
            state = self._inbound.setdefault(key, _Inbound())
            if expected is None:
                state.landed += 1
            else:
                state.expected = expected
            if error is not None and state.error is None:
                state.error = error
            if state.landed != state.expected:
                return
            del self._inbound[key]
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


class _Link:
    """The streams to one peer and the batches in flight on them. Fails as a whole."""

    def __init__(self, transport: TcpTransport, peer: str, address: str):
        self.transport = transport
        self.peer = peer
        self.address = address
        self.session = int.from_bytes(os.urandom(8), "big")
        self.failed: TransferError | None = None
        self.pending: dict[int, Batch] = {}  # WRITE batches and messages awaiting their ACK
        self.reads: dict[int, _Read] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last_heard = time.monotonic()
        n = transport._config.tcp_streams
        self.streams = [_Stream(self, i) for i in range(n)]

    def _register(self, batch: Batch, read: _Read | None = None) -> int | None:
        batch_id = next(self._ids)
        with self.lock:
            if self.failed is not None:
                error = self.failed
            else:
                if read is None:
                    self.pending[batch_id] = batch
                else:
                    self.reads[batch_id] = read
                error = None
        if error is not None:
            batch.complete(error)
            return None
        batch.add_done_callback(lambda _: self._unregister(batch_id))
        return batch_id

    def _unregister(self, batch_id: int) -> None:
        with self.lock:
            self.pending.pop(batch_id, None)
            self.reads.pop(batch_id, None)

    def write(self, slices: list[Slice], batch: Batch, message: OutgoingMessage | None) -> None:
        frames = plan_frames(slices, len(self.streams)) if slices else []
        batch_id = self._register(batch)
        if batch_id is None:
            return
        n = len(self.streams)
        for i, stream in enumerate(self.streams):
            mine = frames[i::n]
            if mine:
                stream.put((Kind.DATA, batch_id, mine))
        self.streams[len(frames) % n].put((Kind.BATCH, batch_id, (len(frames), slices, message)))

    def read(self, slices: list[Slice], batch: Batch) -> None:
        frames = plan_frames(slices, len(self.streams))
        try:
            dests = [[self._local_view(lreg, loff, length) for lreg, loff, _, _, length in frame] for frame in frames]
        except TransferError as exc:
            batch.complete(exc)
            return
        batch_id = self._register(batch, _Read(batch, dests, len(frames)))
        if batch_id is None:
            return
        n = len(self.streams)
        for i, stream in enumerate(self.streams):
            mine = [[i + k * n, [[rreg, roff, length] for _, _, rreg, roff, length in frame]]
                    for k, frame in enumerate(frames[i::n])]
            if mine:
                stream.put((Kind.READ, batch_id, mine))

    def message(self, payload: bytes, batch: Batch) -> None:
        batch_id = self._register(batch)
        if batch_id is not None:
            self.streams[0].put((Kind.MSG, batch_id, payload))

    def _local_view(self, region_name: str, offset: int, length: int) -> memoryview:
        region = self.transport.regions.get(region_name)
        region.check(offset, length)
        if region.view is None:
            raise TransferError(f"region {region_name!r} is device memory: tcp cannot reach it")
        return region.view[offset:offset + length]

    def live(self, batch_id: int) -> bool:
        return batch_id in self.pending or batch_id in self.reads

    def busy(self) -> bool:
        return bool(self.pending or self.reads)

    def heard(self) -> None:
        self._last_heard = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self._last_heard

    def fail(self, error: TransferError) -> None:
        with self.lock:
            if self.failed is not None:
                return
            self.failed = error
            batches = list(self.pending.values()) + [r.batch for r in self.reads.values()]
            self.pending, self.reads = {}, {}
        self.transport._forget(self)
        for stream in self.streams:
            stream.stop()
        for batch in batches:
            batch.complete(error)

    # ACKs and read data, from any stream's reader thread.
    def on_ack(self, batch_id: int, error: bytes) -> None:
        with self.lock:
            batch = self.pending.pop(batch_id, None)
        if batch is not None:
            batch.complete(TransferError(f"{self.peer}: {error.decode(errors='replace')}") if error else None)


class _Stream:
    """One connection of a link: a sender thread draining a queue, a reader thread for replies."""

    def __init__(self, link: _Link, index: int):
        self.link = link
        self.index = index
        self.sock: socket.socket | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_loop, name=f"messenger-tcp-out{index}", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        self._queue.put(None)
        if self.sock is not None:
            _shutdown(self.sock)

    def _connect(self) -> None:
        transport = self.link.transport
        config = transport._config
        sock = socket.create_connection(parse_address(self.link.address), timeout=config.timeout_s)
        _tune(sock)
        if config.auth_key is not None:
            client_handshake(sock, config.auth_key)
        hello = _encode([transport.local_name])
        sock.sendall(frame := encode_engine_prefix(Kind.HELLO, self.link.session, 0, hello, 0))
        transport.stats_counter.moved(sent=len(frame))
        self.sock = sock
        if self.link.failed is not None:  # failed while connecting: stop() saw no socket yet
            _shutdown(sock)
        threading.Thread(target=self._read_loop, name=f"messenger-tcp-ack{self.index}", daemon=True).start()

    def _send_loop(self) -> None:
        link, transport = self.link, self.link.transport
        try:
            while True:
                item = self._queue.get()
                if item is None or link.failed is not None:
                    return
                if self.sock is None:
                    self._connect()
                kind, batch_id, body = item
                if not link.live(batch_id):
                    continue  # timed out or failed while queued
                if kind == Kind.DATA:
                    for frame in body:
                        segments = [[rreg, roff, length] for _, _, rreg, roff, length in frame]
                        views = [link._local_view(lreg, loff, length) for lreg, loff, _, _, length in frame]
                        transport._send(self.sock, Kind.DATA, batch_id, 0, _encode(segments), views)
                        link.heard()  # progress: a big batch's ack may be seconds away, but bytes move
                elif kind == Kind.BATCH:
                    count, slices, message = body
                    # Reading message.checksums waits for the hashes, computed while the data went out.
                    var = _encode([[[s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length]
                                    for s in slices],
                                   message.payload if message is not None else None,
                                   list(message.checksums) if message is not None else []])
                    transport._send(self.sock, Kind.BATCH, batch_id, count, var)
                elif kind == Kind.READ:
                    transport._send(self.sock, Kind.READ, batch_id, 0, _encode(body))
                elif kind == Kind.MSG:
                    transport._send(self.sock, Kind.MSG, batch_id, 0, bytes(body))
        except HandshakeError as exc:
            link.fail(TransferError(f"{link.peer} at {link.address} refused the handshake: {exc}"))
        except TransferError as exc:  # a local region vanished under a queued frame
            link.fail(exc)
        except (OSError, ValueError) as exc:
            link.fail(TransferError(f"sending to {link.peer} at {link.address} failed: {exc}"))
        except Exception as exc:  # e.g. the checksums failed: never leave batches hanging
            link.fail(TransferError(f"sending to {link.peer} failed: {type(exc).__name__}: {exc}"))

    def _read_loop(self) -> None:
        link, transport, sock = self.link, self.link.transport, self.sock
        timeout = transport._config.timeout_s
        sock.settimeout(min(1.0, timeout))
        prefix = bytearray(ENGINE_PREFIX_SIZE)
        try:
            while link.failed is None:
                try:
                    got = sock.recv_into(prefix)
                except socket.timeout:
                    if link.busy() and link.silent_for() > timeout:
                        raise TransferError(f"{link.peer} at {link.address} silent for {timeout} s") from None
                    continue
                if got == 0:
                    raise WireError("the peer closed the connection")
                sock.settimeout(timeout)  # mid-frame: the rest must follow
                if got < ENGINE_PREFIX_SIZE:
                    recv_into_views(sock, [memoryview(prefix)[got:]])
                kind, var_len, batch_id, arg, payload_len = decode_engine_prefix(prefix)
                var = bytes(recv_exactly(sock, var_len)) if var_len else b""
                link.heard()
                if kind == Kind.ACK:
                    link.on_ack(batch_id, var)
                elif kind in (Kind.READ_DATA, Kind.READ_ERR):
                    self._on_read_reply(kind, batch_id, arg, var, payload_len)
                else:
                    raise WireError(f"unexpected frame kind {kind} from a server")
                transport.stats_counter.moved(received=ENGINE_PREFIX_SIZE + var_len + payload_len)
                sock.settimeout(min(1.0, timeout))
        except TransferError as exc:
            link.fail(exc)
        except (OSError, ValueError) as exc:
            link.fail(TransferError(f"connection to {link.peer} at {link.address} lost: {exc}"))

    def _on_read_reply(self, kind: int, batch_id: int, index: int, var: bytes, payload_len: int) -> None:
        link = self.link
        read = link.reads.get(batch_id)
        if kind == Kind.READ_ERR:
            if read is not None:
                read.batch.complete(TransferError(f"{link.peer} refused the read: {var.decode(errors='replace')}"))
            return
        views = read.frames[index] if read is not None and index < len(read.frames) else None
        if views is None or read.batch.done() or sum(v.nbytes for v in views) != payload_len:
            _drain(self.sock, payload_len)  # a batch that timed out: its memory is no longer ours to fill
            return
        recv_into_views(self.sock, views)
        with link.lock:
            read.remaining -= 1
            finished = read.remaining == 0
        if finished:
            read.batch.complete(None)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
