"""The shm transport: peers on the same host, one copy at most.

How bytes move, best first, decided per connection when it opens:
1. Cross-memory attach (messenger/cma.py). The side that owns the target region of a batch (the
   receiver of a write, the source of a read) copies straight between its memory and the
   initiator's with one process_vm_readv/writev per IOV_MAX slices, on several threads when the
   batch is large. Any memory works (numpy arrays, tensors vLLM allocated); nothing is shared
   beforehand. The owner copies a write, not the initiator, because only the owner knows, at the
   moment of the copy, that its region is still registered at that address: an initiator writing
   into a peer's memory from an address it learnt earlier could scribble on memory since freed.
   A read is the other way round: process_vm_writev runs at about half the speed of
   process_vm_readv here, so the initiator reads the owner's memory itself at the addresses the
   owner gave, and the owner then confirms they still hold those regions (or the read fails:
   stale bytes are never returned as good ones). That copy is a landing of the batch
   (Batch.begin_landing): a timeout waits for it, so a caller whose read failed owns its memory
   again. One the owner copies into this side (when this side may not read the owner, or its
   regions are in segments the owner maps) cannot be held back like that: the owner starts none
   past the batch's deadline, but one under way then still finishes.
   Whether CMA is permitted is checked, not assumed: the owner reads a random probe the
   initiator publishes, at the initiator's pid as the kernel reports it (SO_PEERCRED), so a
   ptrace_scope, another uid, a seccomp filter or another pid namespace turns it off. Under
   Yama's ptrace_scope 1 (only ancestors may attach) each process declares same-uid peers
   allowed (PR_SET_PTRACER, `ShmConfig.allow_ptracer`), since two workers are siblings.
2. Shared-memory segments (messenger/segments.py), when CMA is off (`ShmConfig.use_cma=False`
   forces it). If the initiator's slices lie in segments, the owner maps them and copies; else
   if the owner's do, the initiator maps the owner's segments and copies, then tells the owner,
   which checks the segments still hold those regions. Private memory on both sides cannot be
   reached this way: such a batch fails and says to allocate one side as a `SharedBuffer` (or
   to leave shm out of EngineConfig.transports, so peers on one host use tcp).

Control (which slices, notifications, acknowledgements, messages) travels on an AF_UNIX socket
in the abstract namespace (messenger/shm_wire.py), never with the bytes. Each peer pair has one
connection per direction. The initiator's side (messenger/shm_link.py) sends requests in
submission order and completes batches as acknowledgements arrive, so many batches are in flight
at once; the owner's side (messenger/shm_serve.py) copies batch after batch and hands each to the
engine on a second thread while it copies the next, so notifications from one peer arrive in
the order of its batches.

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
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from messenger import cma, shm_wire
from messenger.api import (Batch, Direction, InboundHandler, OutgoingMessage, PeerInfo, Region, RegionTable, Slice,
                           TransferError)
from messenger.segments import SHM_DIR, PeerSegments, SegmentSpan, segment_of
from messenger.shm_link import Job, Link, shutdown
from messenger.shm_serve import Served
from messenger.stats import TransportStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShmConfig:
    """Settings of the shm transport (the engine's EngineConfig holds what all transports share)."""

    use_cma: bool = True
    """Copy by cross-memory attach where the kernel permits it; False forces segments."""
    allow_ptracer: bool = True
    """Under Yama's ptrace_scope 1, let same-uid peers attach (prctl PR_SET_PTRACER_ANY) so
    sibling workers can copy by CMA; it grants any process of this uid what scope 0 grants."""
    copy_threads: int = 0
    """Threads one large batch is cut across (the serving one included); 0: min(4, cores)."""
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


class ShmTransport:
    """The Transport of messenger/api.py for peers on the same host (see the module's notes).

    Built by the engine as ShmTransport(engine_config): it reads only `auth_key` (and `shm`, a
    ShmConfig, if the engine's config has one). Its public attributes below the Transport
    methods are for its two halves, shm_link.Link and shm_serve.Served.
    """

    name = "shm"

    def __init__(self, config: Any = None, shm: ShmConfig | None = None, name: str | None = None):
        self.auth_key: bytes | None = getattr(config, "auth_key", None)
        self.config = shm or getattr(config, "shm", None) or ShmConfig()
        self._name = name  # what peers' on_notify are told this side is; start() learns the engine's
        self._stats = TransportStats()
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}
        self._served: set[socket.socket] = set()
        self._own_spans: dict[tuple[str, int, int], SegmentSpan | None] = {}
        self.segments = PeerSegments()
        self.closed = False
        self._regions: RegionTable | None = None
        self.deliver: InboundHandler = None  # type: ignore[assignment]  # set by start()
        self._listener: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.probe = secrets.token_bytes(16)
        self._probe_buffer = ctypes.create_string_buffer(self.probe, len(self.probe))
        self.probe_address = ctypes.addressof(self._probe_buffer)  # stable: peers read it by CMA
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
        self._regions, self.deliver = regions, deliver
        self._name = self._name or getattr(deliver, "name", None)  # the engine is the handler
        if not self.config.use_cma:
            self.cma_reason = "disabled (ShmConfig.use_cma=False)"
        else:  # the calls exist and no seccomp filter refuses them; each peer is probed on connect
            self.cma_reason = cma.probe(os.getpid(), self.probe_address, self.probe)
            if self.cma_reason is None and self.config.allow_ptracer:
                cma.allow_any_ptracer()
        if self.cma_reason is not None:
            log.info("shm transport copies through shared-memory segments: CMA %s", self.cma_reason)
        self._pool = ThreadPoolExecutor(max(1, self.config.threads() - 1), thread_name_prefix="shm-copy")
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
            local = [self.region(s.local_region, s.local_offset, s.length) for s in slices]
        except TransferError as exc:
            batch.complete(exc)
            return
        self._enqueue(peer, Job(batch, direction, slices, local, message))

    def unregister(self, name: str) -> None:
        """Nothing to release: regions are looked up by name for every batch."""

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        self._enqueue(peer, Job(batch, None, [], [], OutgoingMessage(payload)))

    def stats(self) -> dict:
        return self._stats.snapshot()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            links, self._links = list(self._links.values()), {}
            served, self._served = list(self._served), set()
        for sock in [s for s in (self._listener,) if s is not None] + served:
            shutdown(sock)
        for link in links:
            link.die("the shm transport was closed")
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self.segments.close()

    # -- for both halves -------------------------------------------------------------------
    def local_name(self) -> str:
        return self._name or f"pid-{os.getpid()}"

    def region(self, region_name: str, offset: int, length: int) -> Region:
        """This side's CPU region `region_name`, with [offset, offset + length) checked."""
        assert self._regions is not None, "start() first"
        try:
            region = self._regions.get(region_name)
        except Exception as exc:  # the table's own error type: unknown region
            raise TransferError(f"no registered region {region_name!r}: {exc}") from None
        if region.device != "cpu":
            raise TransferError(f"region {region_name!r} is on {region.device}: shm reaches CPU memory only")
        region.check(offset, length)
        return region

    def span(self, region: Region, offset: int) -> SegmentSpan | None:
        """The segment span of `region` at `offset`, None if the region is private memory."""
        key = (region.name, region.address, region.length)
        if key not in self._own_spans:  # /proc/self/maps is read once per registration
            self._own_spans[key] = segment_of(region.address, region.length)
        span = self._own_spans[key]
        return None if span is None else SegmentSpan(span.name, span.offset + offset)

    def copy(self, copies: list[cma.Copy], *, write: bool, pid: int | None) -> None:
        """Copy local->remote (`write`) or back, by CMA with `pid`, or by memmove when the
        remote addresses are a peer's segment mapped here (`pid` None)."""
        run = ((lambda chunk: cma.transfer(pid, chunk, write=write)) if pid is not None
               else (lambda chunk: cma.memmove(chunk, write=write)))
        cma.in_parallel(run, copies, pool=self._pool, threads=self.config.threads(),
                        parallel_min_bytes=self.config.parallel_min_bytes)

    def count_served(self, nbytes: int, write: bool) -> None:
        """A peer's batch moved into (its write) or out of (its read) this side's memory."""
        if write:
            self._stats.moved(received=nbytes)
        else:
            self._stats.moved(sent=nbytes)

    def count_done(self, nbytes: int, write: bool, seconds: float) -> None:
        """A batch this side started completed."""
        if write:
            self._stats.moved(sent=nbytes)
        else:
            self._stats.moved(received=nbytes)
        self._stats.request(seconds)

    def forget(self, link: Link) -> None:
        """`link` died: the next batch to its peer opens a new one."""
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]

    def plan(self, link: Link, job: Job) -> shm_wire.Move:
        """The request for `job` (Link's sender thread); when the way is the owner's segments,
        this side copies first."""
        write = job.direction == Direction.WRITE
        tuples = [(s.local_region, s.local_offset, s.remote_region, s.remote_offset, s.length) for s in job.slices]
        message = job.message
        common = dict(id=0, write=write, slices=tuples, message=None if message is None else message.payload,
                      sums_follow=write and message is not None, deadline=job.batch.deadline or 0.0)
        if link.cma and not write and link.pull_pid is not None:
            return self._pull(link, job, common)
        if link.cma:
            return shm_wire.Move(mode="cma", addresses=[r.address + s.local_offset
                                                          for r, s in zip(job.local, job.slices)], **common)
        mine = [self.span(r, s.local_offset) for r, s in zip(job.local, job.slices)]
        if all(mine):
            return shm_wire.Move(mode="mapped", spans=[(m.name, m.offset) for m in mine], **common)
        regions = [s.remote_region for s in job.slices]
        if write:
            # This side writes into the owner's memory before the owner checks anything: where a
            # region lies is asked afresh (one round trip), or a region the owner moved would take
            # the bytes at its old place, which may hold another region by now.
            link.forget_where(regions)
        theirs = link.where(regions)
        for (_, _, length), s in zip(theirs, job.slices):
            if s.remote_offset + s.length > length:  # checked before any byte moves, as _pull does
                raise TransferError(f"slice [{s.remote_offset}, {s.remote_offset + s.length}) is outside "
                                    f"{link.peer!r}'s region {s.remote_region!r} of {length} B")
        spans = [None if t is None else SegmentSpan(t.name, t.offset + s.remote_offset)
                 for (t, _, _), s in zip(theirs, job.slices)]
        if not all(spans):
            raise TransferError(
                f"shm cannot reach peer {link.peer!r}: cross-memory attach is off ({link.cma_reason}) and "
                f"neither side's regions are in shared memory (allocate one as messenger.segments.SharedBuffer)")
        try:
            copies = [(r.address + s.local_offset, self.segments.address(span, s.length), s.length)
                      for r, s, span in zip(job.local, job.slices, spans)]
        except (OSError, ValueError) as exc:
            raise TransferError(f"cannot map peer {link.peer!r}'s segment: {exc}") from None
        if write:
            _still_wanted(job)
            self.copy(copies, write=True, pid=None)
        else:
            self._copy_in(job, copies, pid=None)
        return shm_wire.Move(mode="done", spans=[(p.name, p.offset) for p in spans], **common)

    def _pull(self, link: Link, job: Job, common: dict) -> shm_wire.Move:
        """A read copied here by process_vm_readv from the owner's memory, at the addresses it
        gave (bounds checked against the lengths it gave); the owner then checks they still hold
        those regions, so a region that moved fails the read instead of returning stale bytes."""
        bases = link.where([s.remote_region for s in job.slices])
        theirs = []
        for (_, base, length), s in zip(bases, job.slices):
            if s.remote_offset + s.length > length:
                raise TransferError(f"slice [{s.remote_offset}, {s.remote_offset + s.length}) is outside "
                                    f"{link.peer!r}'s region {s.remote_region!r} of {length} B")
            theirs.append(base + s.remote_offset)
        assert link.pull_pid is not None
        try:
            self._copy_in(job, [(r.address + s.local_offset, t, s.length)
                                for r, s, t in zip(job.local, job.slices, theirs)], pid=link.pull_pid)
        except TransferError:  # the batch had ended: nothing was copied
            raise
        except OSError as exc:
            link.forget_where()
            raise TransferError(f"reading {link.peer!r}'s memory failed: {exc}") from None
        return shm_wire.Move(mode="pulled", addresses=theirs, **common)

    # -- internals -------------------------------------------------------------------------
    def _copy_in(self, job: Job, copies: list[cma.Copy], *, pid: int | None) -> None:
        """A read's bytes copied into this side's memory by this side, as a landing of its batch
        (Batch.begin_landing): nothing once the batch ended, and a timeout meanwhile waits for the
        copy to finish, so the caller never gets its memory back while it is being written."""
        if not job.batch.begin_landing():
            raise TransferError("the batch ended (timed out) before its copy began")
        try:
            self.copy(copies, write=False, pid=pid)
        finally:
            job.batch.end_landing()

    def _enqueue(self, peer: PeerInfo, job: Job) -> None:
        """Queue `job` on the link to `peer`, opening one if there is none (or the last died)."""
        address = _socket_of(peer)
        if job.direction is None and address is not None:  # a message: on this thread if the link is idle
            with self._lock:
                link = None if self.closed else self._links.get(address)
            if link is not None and link.send_now(job):
                return
        with self._lock:
            closed = self.closed
            if not closed and address is not None:
                link = self._links.get(address)
                if link is None:
                    link = self._links[address] = Link(self, peer.name, address)
                    link.start()
                link.put(job)  # under the lock: never after a dead link's sentinel (Link.die)
                return
        job.batch.complete(TransferError("the shm transport was closed" if closed
                                         else f"peer {peer.name!r} publishes no shm address"))

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self.closed:
                    shutdown(conn)
                    return
                self._served.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shm-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            Served(self, conn).run()
        finally:
            with self._lock:
                self._served.discard(conn)


def _socket_of(peer: PeerInfo) -> str | None:
    descriptor = peer.transports.get(ShmTransport.name)
    if not descriptor:
        return None
    try:
        return str(json.loads(descriptor)["socket"])
    except (ValueError, KeyError, TypeError):
        return None


def _still_wanted(job: Job) -> None:
    """Raise if `job`'s batch already ended (timed out while queued or asking where): its
    memory may be its caller's again, so nothing may be copied into or out of it."""
    if job.batch.done():
        raise TransferError("the batch ended (timed out) before its copy began")
