"""The shm transport: peers on the same host, one copy at most.

How bytes move, best first, decided per connection when it opens:
1. Cross-memory attach (messenger/cma.py). The side that owns the target region of a batch (the
   receiver of a write, the source of a read) copies straight between its memory and the
   initiator's with one process_vm_readv/writev per IOV_MAX slices, on several threads when the
   batch is large. Any memory works (numpy arrays, tensors vLLM allocated); nothing is shared
   beforehand. The owner copies, not the initiator, because only the owner knows, at the moment
   of the copy, that its region is still registered at that address: an initiator writing into
   a peer's memory from an address it learnt earlier could scribble on memory since freed.
   Whether CMA is permitted is checked, not assumed: the owner reads a random probe the
   initiator publishes, at the initiator's pid as the kernel reports it (SO_PEERCRED), so a
   ptrace_scope, another uid, a seccomp filter or another pid namespace turns it off.
2. Shared-memory segments (messenger/segments.py), when CMA is off (`ShmConfig.use_cma=False`
   forces it). If the initiator's slices lie in segments, the owner maps them and copies; else
   if the owner's do, the initiator maps the owner's segments and copies, then tells the owner,
   which checks the segments still hold those regions. Private memory on both sides cannot be
   reached this way: such a batch fails and says to allocate one side as a `SharedBuffer`.

Control (which slices, notifications, acknowledgements, messages) travels on an AF_UNIX socket
in the abstract namespace (messenger/shm_wire.py), never with the bytes. Each peer pair has one
connection per direction: the initiator's sender thread sends requests in submission order and
its reader thread completes batches as the owner's acknowledgements arrive, so many batches are
in flight at once; the owner serves a connection on one thread, batch after batch, so
notifications from one peer arrive in the order of its batches.

A peer that closes its socket (it died) fails every batch in flight to it at once; one that
hangs is the engine's watchdog's (EngineConfig.timeout_s). Checksums are the engine's.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from messenger import cma, shm_wire
from messenger.api import (Batch, ChecksumError, Direction, InboundHandler, OutgoingMessage, PeerInfo, Region,
                           RegionTable, Slice, TransferError)
from messenger.handshake import HandshakeError, client_handshake, server_handshake
from messenger.segments import SHM_DIR, PeerSegments, SegmentSpan, segment_of
from messenger.stats import TransportStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShmConfig:
    """Settings of the shm transport (the engine's EngineConfig holds what all transports share)."""

    use_cma: bool = True
    """Copy by cross-memory attach where the kernel permits it; False forces segments."""
    copy_threads: int = 0
    """Threads one large batch is cut across (this one included); 0: min(4, cores)."""
    parallel_min_bytes: int = 4 << 20
    """A batch smaller than this is copied by one thread (a hand-off costs more than it saves)."""
    connect_timeout_s: float = 5.0
    """How long opening a connection (handshake, hello) or asking a peer's segments may take."""

    def __post_init__(self) -> None:
        if self.copy_threads < 0 or self.parallel_min_bytes <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"bad ShmConfig {self}: copy_threads >= 0, parallel_min_bytes and "
                             f"connect_timeout_s > 0")

    def threads(self) -> int:
        return self.copy_threads or min(4, os.cpu_count() or 1)


def _peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid in this pid namespace, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def _error_of(ack: shm_wire.Ack) -> TransferError | None:
    if ack.error is None:
        return None
    return ChecksumError(ack.error) if ack.checksum else TransferError(ack.error)


class ShmTransport:
    """The Transport of messenger/api.py for peers on the same host (see the module's notes)."""

    name = "shm"

    def __init__(self, config: Any = None, shm: ShmConfig | None = None, name: str | None = None):
        # Only what every transport shares is read from the engine's config.
        self._auth_key: bytes | None = getattr(config, "auth_key", None)
        self.config = shm or getattr(config, "shm", None) or ShmConfig()
        self._name = name or getattr(config, "name", None)
        self._stats = TransportStats()
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._served: set[socket.socket] = set()
        self._own_spans: dict[tuple[str, int, int], SegmentSpan | None] = {}
        self._segments = PeerSegments()
        self._closed = False
        self._regions: RegionTable | None = None
        self._deliver: InboundHandler | None = None
        self._listener: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._probe = secrets.token_bytes(16)
        self._probe_buffer = None
        self.cma_reason: str | None = "not started"
        """None when this process can copy by CMA at all; per peer, the probe decides."""

    # -- Transport -------------------------------------------------------------------------
    def available(self) -> str | None:
        if not sys.platform.startswith("linux"):
            return "shm needs Linux (abstract AF_UNIX sockets, process_vm_readv or /dev/shm)"
        if cma.supported() is not None and not os.path.isdir(SHM_DIR):
            return f"neither cross-memory attach ({cma.supported()}) nor {SHM_DIR} is available"
        return None

    def start(self, regions: RegionTable, deliver: InboundHandler) -> str:
        self._regions, self._deliver = regions, deliver
        # The probe lives at a stable address for peers to read by CMA.
        self._probe_buffer = ctypes.create_string_buffer(self._probe, len(self._probe))
        if not self.config.use_cma:
            self.cma_reason = "disabled (ShmConfig.use_cma=False)"
        else:  # the calls exist and no seccomp filter refuses them; peers are probed on connect
            self.cma_reason = cma.probe(os.getpid(), ctypes.addressof(self._probe_buffer), self._probe)
        if self.cma_reason is not None:
            log.info("shm transport copies through shared-memory segments: CMA %s", self.cma_reason)
        threads = self.config.threads()
        self._pool = ThreadPoolExecutor(max(1, threads - 1), thread_name_prefix="shm-copy")
        address = f"mooncake-shm-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + address)  # abstract: no file to clean up, gone with the process
        self._listener.listen(64)
        threading.Thread(target=self._accept_loop, name="shm-accept", daemon=True).start()
        return json.dumps({"socket": address, "pid": os.getpid()})

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        self._name = self._name or local.name  # what peers' on_notify will be told we are
        return local.host_id == peer.host_id and _socket_of(peer) is not None

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        try:
            local = [self._local(s.local_region, s.local_offset, s.length) for s in slices]
        except TransferError as exc:
            batch.complete(exc)
            return
        self._enqueue(peer, _Job(batch, direction, slices, local, message))

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        self._enqueue(peer, _Job(batch, None, [], [], OutgoingMessage(payload)))

    def stats(self) -> dict:
        return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            served, self._served = list(self._served), set()
        for sock in [s for s in (self._listener,) if s is not None] + served:
            _shutdown(sock)
        for link in links:
            link.die("the shm transport was closed")
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._segments.close()

    # -- shared by both sides --------------------------------------------------------------
    def _local(self, region_name: str, offset: int, length: int) -> Region:
        assert self._regions is not None, "start() first"
        try:
            region = self._regions.get(region_name)
        except Exception as exc:  # the table's own error type: unknown region
            raise TransferError(f"no registered region {region_name!r}: {exc}") from None
        if region.device != "cpu":
            raise TransferError(f"region {region_name!r} is on {region.device}: shm reaches CPU memory only")
        region.check(offset, length)
        return region

    def _span(self, region: Region, offset: int) -> SegmentSpan | None:
        """The segment span of `region` at `offset`, None if the region is private memory."""
        key = (region.name, region.address, region.length)
        if key not in self._own_spans:  # /proc/self/maps is read once per registration
            self._own_spans[key] = segment_of(region.address, region.length)
        span = self._own_spans[key]
        return None if span is None else SegmentSpan(span.name, span.offset + offset)

    def _copy(self, copies: list[cma.Copy], *, write: bool, pid: int | None) -> None:
        """Copy local->remote (`write`) or back, by CMA into `pid`, or by memmove when the
        remote addresses are a peer's segment mapped here (`pid` None)."""
        run = ((lambda chunk: cma.transfer(pid, chunk, write=write)) if pid is not None
               else (lambda chunk: cma.memmove(chunk, write=write)))
        cma.in_parallel(run, copies, pool=self._pool, threads=self.config.threads(),
                        parallel_min_bytes=self.config.parallel_min_bytes)

    # -- initiator side --------------------------------------------------------------------
    def _enqueue(self, peer: PeerInfo, job: _Job) -> None:
        """Queue `job` on the link to `peer`, opening one if there is none (or the last died)."""
        address = _socket_of(peer)
        with self._lock:
            closed = self._closed
            if not closed and address is not None:
                link = self._links.get(address)
                if link is None:
                    link = self._links[address] = _Link(self, peer.name, address)
                    link.start()
                link.jobs.put(job)  # under the lock: never after a dead link's sentinel (_Link.die)
                return
        job.batch.complete(TransferError("the shm transport was closed" if closed
                                         else f"peer {peer.name!r} publishes no shm address"))

    def _forget(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    def _plan(self, link: _Link, job: _Job) -> shm_wire.Move:
        """The request for `job`, after copying it here when the owner's segments are the way."""
        write = job.direction == Direction.WRITE
        tuples = [(s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length) for s in job.slices]
        message = job.message
        common = dict(id=0, write=write, slices=tuples, message=None if message is None else message.payload,
                      checksums=[] if message is None else list(message.checksums))
        if link.cma:
            return shm_wire.Move(mode="cma", addresses=[r.address + s.local_offset
                                                          for r, s in zip(job.local, job.slices)], **common)
        mine = [self._span(r, s.local_offset) for r, s in zip(job.local, job.slices)]
        if all(mine):
            return shm_wire.Move(mode="mapped", spans=[(m.name, m.offset) for m in mine], **common)
        theirs = link.where([s.remote_region for s in job.slices])
        spans = [None if t is None else SegmentSpan(t.name, t.offset + s.remote_offset)
                 for t, s in zip(theirs, job.slices)]
        if not all(spans):
            raise TransferError(
                f"shm cannot reach peer {link.peer!r}: cross-memory attach is off ({link.cma_reason}) and "
                f"neither side's regions are in shared memory (allocate one as messenger.segments.SharedBuffer)")
        try:
            copies = [(r.address + s.local_offset, self._segments.address(span, s.length), s.length)
                      for r, s, span in zip(job.local, job.slices, spans)]
        except (OSError, ValueError) as exc:
            raise TransferError(f"cannot map peer {link.peer!r}'s segment: {exc}") from None
        self._copy(copies, write=write, pid=None)
        return shm_wire.Move(mode="done", spans=[(p.name, p.offset) for p in spans], **common)

    # -- owner side ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    _shutdown(conn)
                    return
                self._served.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shm-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid = _peer_pid(conn)
            conn.settimeout(self.config.connect_timeout_s)  # a silent stranger cannot hold a thread
            if self._auth_key is not None:
                server_handshake(conn, self._auth_key)
            hello = shm_wire.recv_request(conn)
            if not isinstance(hello, shm_wire.Hello):
                raise ConnectionError(f"expected hello, got {type(hello).__name__}")
            reason = (self.cma_reason or ("the peer disabled it" if not hello.cma else None)
                      or cma.probe(pid, hello.probe_address, hello.probe))
            shm_wire.send(conn, shm_wire.HelloReply(self._name or f"pid-{os.getpid()}", reason is None, reason))
            conn.settimeout(None)
            while (request := shm_wire.recv_request(conn)) is not None:
                shm_wire.send(conn, self._answer(hello.name, pid if reason is None else None, request))
        except (OSError, HandshakeError) as exc:
            if not self._closed:
                log.debug("shm connection ended: %s", exc)
        finally:
            with self._lock:
                self._served.discard(conn)
            conn.close()

    def _answer(self, peer: str, pid: int | None, request: shm_wire.Request) -> shm_wire.Reply:
        assert self._deliver is not None
        if isinstance(request, shm_wire.Where):
            try:
                spans = [self._span(self._local(name, 0, 0), 0) for name in request.regions]
            except TransferError as exc:
                return shm_wire.WhereReply(request.id, [], str(exc))
            return shm_wire.WhereReply(request.id, [None if s is None else (s.name, s.offset) for s in spans])
        try:
            if isinstance(request, shm_wire.Note):
                self._deliver.message(peer, request.payload)
                return shm_wire.Ack(request.id)
            if not isinstance(request, shm_wire.Move):
                return shm_wire.Ack(getattr(request, "id", -1), f"unexpected {type(request).__name__}")
            slices = [Slice(*t) for t in request.slices]
            self._land(pid, request, slices)
            if not request.write:
                return shm_wire.Ack(request.id)
            message = (None if request.message is None
                       else OutgoingMessage(request.message, tuple(request.checksums)))
            error = self._deliver.slices_landed(peer, slices, message)
        except (TransferError, OSError, ValueError) as exc:
            return shm_wire.Ack(request.id, f"shm {'write' if getattr(request, 'write', True) else 'read'} "
                                            f"refused by {self._name}: {exc}")
        except Exception as exc:  # the engine's handler failed: the peer must get an answer, never a hang
            log.exception("shm inbound handler failed")
            return shm_wire.Ack(request.id, f"{type(exc).__name__}: {exc}")
        # The engine verifies checksums; its error text is the only sign of which failure it was.
        return shm_wire.Ack(request.id, error, error is not None and "checksum" in error.lower())

    def _land(self, pid: int | None, move: shm_wire.Move, slices: list[Slice]) -> None:
        """Copy `move`'s bytes between this side's regions and the initiator, or check the
        initiator's own copy ("done"). Raises TransferError."""
        regions = [self._local(s.remote_region, s.remote_offset, s.length) for s in slices]
        own = [r.address + s.remote_offset for r, s in zip(regions, slices)]
        nbytes = sum(s.length for s in slices)
        if move.mode == "cma":
            if pid is None or len(move.addresses) != len(slices):
                raise TransferError("a cma move on a connection without cma")
            # The initiator's write is this side's read from it, and the other way round.
            self._copy([(o, a, s.length) for o, a, s in zip(own, move.addresses, slices)],
                       write=not move.write, pid=pid)
        elif move.mode == "mapped" and len(move.spans) == len(slices):
            theirs = [self._segments.address(SegmentSpan(*span), s.length) for span, s in zip(move.spans, slices)]
            self._copy([(o, t, s.length) for o, t, s in zip(own, theirs, slices)], write=not move.write, pid=None)
        elif move.mode == "done" and len(move.spans) == len(slices):
            for r, s, span in zip(regions, slices, move.spans):
                if self._span(r, s.remote_offset) != SegmentSpan(*span):
                    raise TransferError(f"region {r.name!r} is no longer in segment {span[0]!r}")
        else:
            raise TransferError(f"bad move mode {move.mode!r}")
        if move.write:
            self._stats.moved(received=nbytes)
        else:
            self._stats.moved(sent=nbytes)


@dataclass
class _Job:
    batch: Batch
    direction: Direction | None  # None: a message without slices
    slices: list[Slice]
    local: list[Region]
    message: OutgoingMessage | None


class _Link:
    """The initiator's connection to one peer: a sender thread that sends requests in order
    (connecting first) and a reader thread that completes batches as acknowledgements come."""

    def __init__(self, transport: ShmTransport, peer: str, address: str):
        self.transport, self.peer, self.address = transport, peer, address
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.cma = False
        self.cma_reason: str | None = "not connected"
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Batch | Future, float, int, bool]] = {}
        self._next_id = 0
        self._where: dict[str, SegmentSpan | None] = {}
        self._dead: str | None = None

    def start(self) -> None:
        threading.Thread(target=self._send_loop, name=f"shm-send-{self.peer}", daemon=True).start()

    def die(self, reason: str) -> None:
        """Fail everything in flight and queued; the transport opens a new link next time."""
        with self._lock:
            if self._dead is None:
                self._dead = reason
            pending, self._pending = self._pending, {}
        self.transport._forget(self)  # no job is queued after the sentinel: both under the transport's lock
        self.jobs.put(None)
        if self._sock is not None:
            _shutdown(self._sock)
        error = TransferError(f"shm peer {self.peer!r}: {self._dead}")
        for waiter, *_ in pending.values():
            if isinstance(waiter, Batch):
                waiter.complete(error)
            elif not waiter.done():
                waiter.set_exception(error)

    def _send_loop(self) -> None:
        try:
            self._connect()
        except (OSError, HandshakeError) as exc:
            self.die(f"cannot connect: {exc}")
        while (job := self.jobs.get()) is not None:
            if self._dead is not None:
                job.batch.complete(TransferError(f"shm peer {self.peer!r}: {self._dead}"))
                continue
            try:
                if job.direction is None:
                    assert job.message is not None
                    request: shm_wire.Move | shm_wire.Note = shm_wire.Note(0, job.message.payload)
                else:
                    request = self.transport._plan(self, job)
                self._request(request, job.batch, sum(s.length for s in job.slices),
                              job.direction == Direction.WRITE)
            except TransferError as exc:
                job.batch.complete(exc)

    def _connect(self) -> None:
        transport = self.transport
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        sock.settimeout(transport.config.connect_timeout_s)
        sock.connect("\0" + self.address)
        if transport._auth_key is not None:
            client_handshake(sock, transport._auth_key)
        shm_wire.send(sock, shm_wire.Hello(transport._name or f"pid-{os.getpid()}",
                                           ctypes.addressof(transport._probe_buffer),
                                           transport._probe, transport.cma_reason is None))
        reply = shm_wire.recv_reply(sock)
        if not isinstance(reply, shm_wire.HelloReply):
            raise ConnectionError(f"shm peer answered the hello with {type(reply).__name__}")
        self.cma, self.cma_reason = reply.cma, reply.reason
        sock.settimeout(None)
        threading.Thread(target=self._read_loop, name=f"shm-read-{self.peer}", daemon=True).start()

    def _request(self, request: Any, waiter: Batch | Future, nbytes: int = 0, write: bool = False) -> None:
        with self._lock:
            if self._dead is not None:
                raise TransferError(f"shm peer {self.peer!r}: {self._dead}")
            self._next_id += 1
            request.id = self._next_id
            self._pending[request.id] = (waiter, time.perf_counter(), nbytes, write)
        try:
            assert self._sock is not None
            shm_wire.send(self._sock, request)
        except OSError as exc:
            self.die(f"control socket failed: {exc}")

    def where(self, regions: list[str]) -> list[SegmentSpan | None]:
        """The owner's segment spans of `regions` (cached; asked once per region)."""
        missing = sorted({r for r in regions if r not in self._where})
        if missing:
            future: Future = Future()
            self._request(shm_wire.Where(0, missing), future)
            try:
                reply = future.result(self.transport.config.connect_timeout_s)
            except TimeoutError:
                raise TransferError(f"shm peer {self.peer!r} did not say where its regions are") from None
            if reply.error is not None:
                raise TransferError(reply.error)
            self._where.update({r: None if s is None else SegmentSpan(*s) for r, s in zip(missing, reply.spans)})
        return [self._where[r] for r in regions]

    def _read_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            while (reply := shm_wire.recv_reply(sock)) is not None:
                with self._lock:
                    entry = self._pending.pop(getattr(reply, "id", -1), None)
                if entry is None:
                    continue
                waiter, started, nbytes, write = entry
                if isinstance(waiter, Future):
                    waiter.set_result(reply)
                    continue
                error = _error_of(reply) if isinstance(reply, shm_wire.Ack) else TransferError("bad reply")
                if error is None:
                    stats = self.transport._stats
                    if write:
                        stats.moved(sent=nbytes)
                    else:
                        stats.moved(received=nbytes)
                    stats.request(time.perf_counter() - started)
                else:
                    self._where.clear()  # a "done" move may have failed on a stale span
                waiter.complete(error)
        except OSError as exc:
            self.die(f"control socket failed: {exc}")
            return
        self.die("closed its control socket (it exited?)")


def _socket_of(peer: PeerInfo) -> str | None:
    descriptor = peer.transports.get(ShmTransport.name)
    if not descriptor:
        return None
    try:
        return str(json.loads(descriptor)["socket"])
    except (ValueError, KeyError, TypeError):
        return None


def _shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked in accept/recv on `sock` (close alone does not), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
