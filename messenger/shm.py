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
import secrets
import socket
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from messenger import cma, shm_wire
from messenger.api import (Batch, Direction, InboundHandler, OutgoingMessage, PeerInfo, Region, RegionTable, Slice,
                           TransferError)
from messenger.handshake import HandshakeError, server_handshake
from messenger.segments import SHM_DIR, PeerSegments, SegmentSpan, segment_of
from messenger.shm_link import Job, Link, shutdown
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


class ShmTransport:
    """The Transport of messenger/api.py for peers on the same host (see the module's notes)."""

    name = "shm"

    def __init__(self, config: Any = None, shm: ShmConfig | None = None, name: str | None = None):
        # Only what every transport shares is read from the engine's config.
        self._auth_key: bytes | None = getattr(config, "auth_key", None)
        self.config = shm or getattr(config, "shm", None) or ShmConfig()
        self._name = name  # the engine's name, what peers' on_notify are told (start() learns it)
        self._stats = TransportStats()
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}
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
        self._name = self._name or getattr(deliver, "name", None)  # the engine is the handler
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
        return local.host_id == peer.host_id and _socket_of(peer) is not None

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        try:
            local = [self._local(s.local_region, s.local_offset, s.length) for s in slices]
        except TransferError as exc:
            batch.complete(exc)
            return
        self._enqueue(peer, Job(batch, direction, slices, local, message))

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        self._enqueue(peer, Job(batch, None, [], [], OutgoingMessage(payload)))

    def stats(self) -> dict:
        return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
            served, self._served = list(self._served), set()
        for sock in [s for s in (self._listener,) if s is not None] + served:
            shutdown(sock)
        for link in links:
            link.die("the shm transport was closed")
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._segments.close()

    def local_name(self) -> str:
        return self._name or f"pid-{os.getpid()}"

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
    def _enqueue(self, peer: PeerInfo, job: Job) -> None:
        """Queue `job` on the link to `peer`, opening one if there is none (or the last died)."""
        address = _socket_of(peer)
        with self._lock:
            closed = self._closed
            if not closed and address is not None:
                link = self._links.get(address)
                if link is None:
                    link = self._links[address] = Link(self, peer.name, address)
                    link.start()
                link.jobs.put(job)  # under the lock: never after a dead link's sentinel (Link.die)
                return
        job.batch.complete(TransferError("the shm transport was closed" if closed
                                         else f"peer {peer.name!r} publishes no shm address"))

    def _count(self, nbytes: int, write: bool, seconds: float) -> None:
        """A batch this side started completed (Link's reader thread)."""
        if write:
            self._stats.moved(sent=nbytes)
        else:
            self._stats.moved(received=nbytes)
        self._stats.request(seconds)

    def _forget(self, link: Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    def _plan(self, link: Link, job: Job) -> shm_wire.Move:
        """The request for `job`, after copying it here when the owner's segments are the way."""
        write = job.direction == Direction.WRITE
        tuples = [(s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length) for s in job.slices]
        message = job.message
        common = dict(id=0, write=write, slices=tuples, message=None if message is None else message.payload,
                      sums_follow=write and message is not None)
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
                    shutdown(conn)
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
            shm_wire.send(conn, shm_wire.HelloReply(self.local_name(), reason is None, reason))
            conn.settimeout(None)
            while (request := shm_wire.recv_request(conn)) is not None:
                if isinstance(request, shm_wire.Move):
                    reply = self._move(conn, hello.name, pid if reason is None else None, request)
                else:
                    reply = self._answer(hello.name, request)
                shm_wire.send(conn, reply)
        except (OSError, HandshakeError) as exc:
            if not self._closed:
                log.debug("shm connection ended: %s", exc)
        finally:
            with self._lock:
                self._served.discard(conn)
            conn.close()

    def _answer(self, peer: str, request: shm_wire.Request) -> shm_wire.Reply:
        """The reply to a request without slices."""
        assert self._deliver is not None
        request_id = getattr(request, "id", -1)
        try:
            if isinstance(request, shm_wire.Where):
                spans = [self._span(self._local(name, 0, 0), 0) for name in request.regions]
                return shm_wire.WhereReply(request_id, [None if s is None else (s.name, s.offset) for s in spans])
            if isinstance(request, shm_wire.Note):
                self._deliver.message(peer, request.payload)
                return shm_wire.Ack(request_id)
            raise TransferError(f"unexpected {type(request).__name__}")
        except TransferError as exc:
            return (shm_wire.WhereReply(request_id, [], str(exc)) if isinstance(request, shm_wire.Where)
                    else shm_wire.Ack(request_id, str(exc)))
        except Exception as exc:  # the engine's handler failed: the peer must get an answer, never a hang
            log.exception("shm inbound message handler failed")
            return shm_wire.Ack(request_id, f"{type(exc).__name__}: {exc}")

    def _move(self, conn: socket.socket, peer: str, pid: int | None, move: shm_wire.Move) -> shm_wire.Ack:
        """Land one batch, read its checksums, hand it to the engine; the Ack for the initiator.
        Raises ConnectionError when the initiator left before its checksums came."""
        assert self._deliver is not None
        error = None
        slices: list[Slice] = []
        try:
            slices = [Slice(*t) for t in move.slices]
            self._land(pid, move, slices)
        except (TransferError, OSError, ValueError) as exc:
            error = f"shm {'write' if move.write else 'read'} refused by {self.local_name()}: {exc}"
        sums = None
        if move.sums_follow:  # read it even after a failure: the connection goes on
            sums = shm_wire.recv_request(conn)
            if not isinstance(sums, shm_wire.Sums) or sums.id != move.id:
                self._lost(peer, move, error or "the sender left before the batch's checksums came")
                raise ConnectionError(f"expected the checksums of batch {move.id}, got {type(sums).__name__}")
            error = error or sums.error
        if error is not None:
            self._lost(peer, move, error)
            return shm_wire.Ack(move.id, error)
        if not move.write:
            return shm_wire.Ack(move.id)
        message = None if move.message is None else OutgoingMessage(
            move.message, () if sums is None else tuple(sums.checksums))
        try:
            error = self._deliver.slices_landed(peer, slices, message)
        except Exception as exc:  # the engine's handler failed: the peer must get an answer, never a hang
            log.exception("shm inbound batch handler failed")
            return shm_wire.Ack(move.id, f"{type(exc).__name__}: {exc}")
        # The engine verifies checksums; its error text is the only sign of which failure it was.
        return shm_wire.Ack(move.id, error, error is not None and "checksum" in error.lower())

    def _lost(self, peer: str, move: shm_wire.Move, error: str) -> None:
        """Tell the engine at once that an inbound write with a message failed (its on_notify
        hears it now, not at a timeout): the engine's optional `batch_failed` hook."""
        hook = getattr(self._deliver, "batch_failed", None)
        if move.write and move.message is not None and hook is not None:
            try:
                hook(peer, OutgoingMessage(move.message), error)
            except Exception:
                log.exception("shm batch_failed handler failed")

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


def _socket_of(peer: PeerInfo) -> str | None:
    descriptor = peer.transports.get(ShmTransport.name)
    if not descriptor:
        return None
    try:
        return str(json.loads(descriptor)["socket"])
    except (ValueError, KeyError, TypeError):
        return None
