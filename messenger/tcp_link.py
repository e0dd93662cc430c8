"""The tcp transport's sending side: one `Link` per peer address, its `tcp_streams` connections
(`Stream`, each with a sender and a reader thread), and how a batch is cut into frames.

See messenger/tcp_transport.py for the protocol; the receiving side lives there.
"""

from __future__ import annotations

import itertools
import os
import queue
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from messenger.api import Batch, OutgoingMessage, Slice, TimedOut, TransferError
from messenger.handshake import HandshakeError, client_handshake
from messenger.send_gate import SendGate
from messenger.stats import TransportStats
from messenger.wire import (ENGINE_PREFIX_SIZE, Kind, WireError, decode_engine_prefix, encode_engine_prefix,
                            recv_exactly, recv_into_views, send_views)

if TYPE_CHECKING:
    from messenger.tcp_transport import TcpTransport

MAX_FRAME_BYTES = 4 << 20  # a larger slice spans frames, so several streams share it
MIN_FRAME_BYTES = 256 << 10  # smaller neighbours share a frame (one header, one syscall)
MAX_FRAME_SEGMENTS = 256  # below IOV_MAX (1024) for sendmsg / recvmsg_into
SOCKET_BUFFER_BYTES = 8 << 20
_SCRATCH_BYTES = 1 << 20
_encode = msgspec.msgpack.encode

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


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


WILDCARD_HOSTS = ("0.0.0.0", "::", "")
"""Bind addresses that mean every interface: no peer can reach them by that name."""


def reachable_host(host: str, advertise_host: str | None) -> str:
    """What peers reach a listener bound to `host` at: itself, or for a wildcard advertise_host,
    else the address the machine's hostname resolves to (on some hosts a loopback one: give
    advertise_host there)."""
    if host in WILDCARD_HOSTS:
        return advertise_host or socket.gethostbyname(socket.gethostname())
    return host


def published_address(listener: socket.socket, advertise_host: str | None) -> str:
    """The "host:port" peers reach a listener at (reachable_host)."""
    host, port = listener.getsockname()[:2]
    return f"{reachable_host(host, advertise_host)}:{port}"


def keep_alive(sock: socket.socket, idle_s: int = 30, interval_s: int = 10, count: int = 3) -> None:
    """Probe an idle connection, so a peer whose host vanished (no FIN ever comes) is noticed
    within about idle_s + interval_s * count seconds instead of never."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def drain(sock: socket.socket, n: int) -> None:
    """Read and drop `n` bytes (a refused segment's), keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, _SCRATCH_BYTES)))
    while n:
        n -= recv_into_views(sock, [scratch[:min(n, scratch.nbytes)]])


def send_frame(stats: TransportStats, conn: socket.socket, kind: int, batch_id: int, arg: int, var: bytes,
               views=()) -> None:
    """One frame: the engine prefix, `var`, then `views` as the payload (sendmsg, no copy)."""
    payload = sum(memoryview(v).nbytes for v in views)
    sent = send_views(conn, [encode_engine_prefix(kind, batch_id, arg, var, payload), *views])
    stats.moved(sent=sent)


@dataclass
class PendingRead:
    batch: Batch
    frames: list[list[memoryview]]
    remaining: int


class Link:
    """The streams to one peer and the batches in flight on them. Fails as a whole."""

    def __init__(self, transport: "TcpTransport", peer: str, address: str):
        self.transport = transport
        self.peer = peer
        self.address = address
        self.session = int.from_bytes(os.urandom(8), "big")
        self.failed: TransferError | None = None
        self.pending: dict[int, Batch] = {}  # WRITE batches and messages awaiting their ACK
        self.reads: dict[int, PendingRead] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._last_heard = time.monotonic()
        n = transport._config.tcp_streams
        self.streams = [Stream(self, i) for i in range(n)]

    def _register(self, batch: Batch, read: PendingRead | None = None) -> int | None:
        batch_id = next(self._ids)
        with self.lock:
            if self.failed is not None:
                error = self.failed
            else:
                if not self.pending and not self.reads:
                    # Silence counts from here: the link was idle, with nothing owed to it, and the
                    # time it sat so is not the peer's. Else its first batch after a quiet spell
                    # longer than timeout_s would fail at the reader's next poll as "silent".
                    self._last_heard = time.monotonic()
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
            unacked = self.pending.pop(batch_id, None) is not None  # on_ack pops first
            self.reads.pop(batch_id, None)
            live = self.failed is None
        if unacked and live:
            # It ended without its ACK (timed out): the receiver must not land it later, nor
            # keep waiting for frames that no longer come.
            self.streams[0].put((Kind.ABORT, batch_id, None))

    def write(self, slices: list[Slice], batch: Batch, message: OutgoingMessage | None) -> None:
        frames = plan_frames(slices, len(self.streams)) if slices else []
        batch_id = self._register(batch)
        if batch_id is None:
            return
        n = len(self.streams)
        self.streams[0].put((Kind.BATCH, batch_id, (len(frames), slices, message)))
        for i, stream in enumerate(self.streams):
            mine = frames[i::n]
            if mine:
                stream.put((Kind.DATA, batch_id, mine))
        self.streams[len(frames) % n].put((Kind.SUMS, batch_id, message))

    def read(self, slices: list[Slice], batch: Batch) -> None:
        frames = plan_frames(slices, len(self.streams))
        if not frames:  # nothing to ask for: no READ frame goes out, so no reply would ever end it
            batch.complete(None)
            return
        try:
            dests = [[self._local_view(lreg, loff, length) for lreg, loff, _, _, length in frame] for frame in frames]
        except TransferError as exc:
            batch.complete(exc)
            return
        batch_id = self._register(batch, PendingRead(batch, dests, len(frames)))
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
        if batch_id is not None and not self.streams[0].send_now(Kind.MSG, batch_id, payload):
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


class Stream:
    """One connection of a link: a sender thread draining a queue, a reader thread for replies.
    A small frame (a call or its reply) goes out on the caller's own thread when nothing is
    queued or being sent: two thread hand-offs fewer on a call's round trip."""

    def __init__(self, link: Link, index: int):
        self.link = link
        self.index = index
        self.sock: socket.socket | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._gate = SendGate()
        self._thread = threading.Thread(target=self._send_loop, name=f"messenger-tcp-out{index}", daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        self._gate.queued()
        self._queue.put(item)

    def send_now(self, kind: int, batch_id: int, body: bytes) -> bool:
        """Send one small frame on this thread if the stream is connected and idle, keeping the
        order of everything queued before it; False: queue it instead."""
        sock = self.sock
        if sock is None or self.link.failed is not None or not self._gate.try_idle():
            return False
        try:
            send_frame(self.link.transport.stats_counter, sock, kind, batch_id, 0, bytes(body))
        except (OSError, ValueError) as exc:
            self.link.fail(TransferError(f"sending to {self.link.peer} at {self.link.address} failed: {exc}"))
        finally:
            self._gate.sending.release()
        return True

    def stop(self) -> None:
        self._queue.put(None)
        if self.sock is not None:
            shutdown_socket(self.sock)

    def _connect(self) -> None:
        transport = self.link.transport
        config = transport._config
        sock = socket.create_connection(parse_address(self.link.address), timeout=config.timeout_s)
        tune_socket(sock)
        sock.settimeout(config.timeout_s)  # a frame that makes no progress for that long fails the link
        try:
            if config.auth_key is not None:
                client_handshake(sock, config.auth_key)
            hello = _encode([transport.local_name])
            sock.sendall(frame := encode_engine_prefix(Kind.HELLO, self.link.session, 0, hello, 0))
        except BaseException:
            shutdown_socket(sock)
            raise
        transport.stats_counter.moved(sent=len(frame))
        self.sock = sock
        if self.link.failed is not None:  # failed while connecting: stop() saw no socket yet
            shutdown_socket(sock)
        threading.Thread(target=self._read_loop, name=f"messenger-tcp-ack{self.index}", daemon=True).start()

    def _send_loop(self) -> None:
        link = self.link
        try:
            while True:
                item = self._queue.get()
                if item is None or link.failed is not None:
                    return
                with self._gate.handling():
                    self._send_item(item)
        except HandshakeError as exc:
            link.fail(TransferError(f"{link.peer} at {link.address} refused the handshake: {exc}"))
        except TransferError as exc:  # a local region vanished under a queued frame
            link.fail(exc)
        except (OSError, ValueError) as exc:
            link.fail(TransferError(f"sending to {link.peer} at {link.address} failed: {exc}"))
        except Exception as exc:  # e.g. the checksums failed: never leave batches hanging
            link.fail(TransferError(f"sending to {link.peer} failed: {type(exc).__name__}: {exc}"))

    def _send_item(self, item) -> None:
        link, transport = self.link, self.link.transport
        if self.sock is None:
            self._connect()
        kind, batch_id, body = item
        if kind == Kind.ABORT:
            send_frame(transport.stats_counter, self.sock, Kind.ABORT, batch_id, 0, b"")
            return
        if not link.live(batch_id):
            return  # timed out or failed while queued
        if kind == Kind.DATA:
            for frame in body:
                if not link.live(batch_id):
                    return  # timed out between frames: its memory may be the caller's again
                segments = [[rreg, roff, length] for _, _, rreg, roff, length in frame]
                try:
                    views = [link._local_view(lreg, loff, length) for lreg, loff, _, _, length in frame]
                except TransferError:
                    if not link.live(batch_id):  # its region went with its timeout: that batch's end only
                        return
                    raise
                send_frame(transport.stats_counter, self.sock, Kind.DATA, batch_id, 0, _encode(segments), views)
                link.heard()  # progress: a big batch's ack may be seconds away, but bytes move
        elif kind == Kind.BATCH:
            count, slices, message = body
            var = _encode([[[s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length]
                            for s in slices], message.payload if message is not None else None])
            send_frame(transport.stats_counter, self.sock, Kind.BATCH, batch_id, count, var)
        elif kind == Kind.SUMS:
            # Reading message.checksums waits for the hashes, computed while the data went out.
            checksums = list(body.checksums) if body is not None else []
            send_frame(transport.stats_counter, self.sock, Kind.SUMS, batch_id, 0, _encode(checksums))
        elif kind == Kind.READ:
            send_frame(transport.stats_counter, self.sock, Kind.READ, batch_id, 0, _encode(body))
        elif kind == Kind.MSG:
            send_frame(transport.stats_counter, self.sock, Kind.MSG, batch_id, 0, bytes(body))

    def _read_loop(self) -> None:
        link, transport, sock = self.link, self.link.transport, self.sock
        timeout = transport._config.timeout_s
        # The socket's own timeout (set in _connect, shared with the sender thread's sendall) bounds
        # a frame in progress; idle waits poll instead, so they never shorten the sender's timeout.
        prefix = bytearray(ENGINE_PREFIX_SIZE)
        # poll, not select.select: select fails for fds >= 1024, and a busy worker (vLLM raises
        # the fd limit) has that many open.
        poller = select.poll()
        idle_ms = int(min(1.0, timeout) * 1000)
        try:
            poller.register(sock, select.POLLIN)  # ValueError if closed already (failed while connecting)
            while link.failed is None:
                if not poller.poll(idle_ms):
                    if link.busy() and link.silent_for() > timeout:
                        raise TimedOut(f"{link.peer} at {link.address} silent for {timeout} s (timed out)")
                    continue
                recv_into_views(sock, [memoryview(prefix)])
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
        if views is None or sum(v.nbytes for v in views) != payload_len or not read.batch.begin_landing():
            drain(self.sock, payload_len)  # a batch that ended (timed out): its memory is no longer ours to fill
            return
        try:  # its timeout, or another stream's READ_ERR or failure, waits until these bytes are in
            recv_into_views(self.sock, views)
        finally:  # the recv may fail (the link broke mid-frame): the batch must still end
            read.batch.end_landing()
        with link.lock:
            read.remaining -= 1
            finished = read.remaining == 0
        if finished:
            read.batch.complete(None)


def shutdown_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
