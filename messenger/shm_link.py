"""The initiator's side of one shm connection (messenger/shm.py): a sender thread that sends
requests in submission order, connecting first, and a reader thread that completes batches as
the owner's acknowledgements arrive, so many batches are in flight at once.

A write's checksums follow its `Move` in a `Sums` frame: the engine hashes the slices while
the owner copies them, and the sender thread waits for the hashes only after the Move is out.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from messenger import cma, shm_wire
from messenger.api import Batch, ChecksumError, Direction, OutgoingMessage, Region, Slice, TransferError
from messenger.handshake import client_handshake
from messenger.segments import SegmentSpan
from messenger.send_gate import SendGate
from messenger.shm_serve import peer_pid

if TYPE_CHECKING:
    from messenger.shm import ShmTransport

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One submitted batch (or message) waiting for the sender thread."""

    batch: Batch
    direction: Direction | None  # None: a message without slices
    slices: list[Slice]
    local: list[Region]  # the region of each slice's local side, checked at submit
    message: OutgoingMessage | None


def shutdown(sock: socket.socket) -> None:
    """Wake a thread blocked in accept/recv on `sock` (close alone does not), then close it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _error_of(ack: shm_wire.Ack) -> TransferError | None:
    if ack.error is None:
        return None
    return ChecksumError(ack.error) if ack.checksum else TransferError(ack.error)


class Link:
    """This process's connection to one peer's shm transport. A message (a call or its reply) goes
    out on the caller's own thread when the sender thread has nothing queued or in hand: two
    thread hand-offs fewer on a call's round trip."""

    def __init__(self, transport: ShmTransport, peer: str, address: str):
        self.transport, self.peer, self.address = transport, peer, address
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._gate = SendGate()
        self._connected = False
        self.cma = False
        self.cma_reason: str | None = "not connected"
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Batch | Future, float, int, bool]] = {}
        self._next_id = 0
        self._where: dict[str, tuple[SegmentSpan | None, int, int]] = {}  # span, address, length
        self.pull_pid: int | None = None  # the owner's pid, when this side may read its memory
        self._dead: str | None = None

    def start(self) -> None:
        threading.Thread(target=self._send_loop, name=f"shm-send-{self.peer}", daemon=True).start()

    def put(self, job: Job) -> None:
        self._gate.queued()
        self.jobs.put(job)

    def send_now(self, job: Job) -> bool:
        """Send a message job on this thread if the link is connected and idle, after everything
        queued before it; False: queue it instead."""
        if not self._connected or self._dead is not None or not self._gate.try_idle():
            return False
        try:
            assert job.message is not None
            try:
                self._request(shm_wire.Note(0, job.message.payload), job.batch)
            except TransferError as exc:
                job.batch.complete(exc)
            return True
        finally:
            self._gate.sending.release()

    def die(self, reason: str) -> None:
        """Fail everything in flight and queued; the transport opens a new link next time."""
        with self._lock:
            if self._dead is None:
                self._dead = reason
            pending, self._pending = self._pending, {}
        self.transport.forget(self)  # no job is queued after the sentinel: both under the transport's lock
        self.jobs.put(None)
        if self._sock is not None:
            shutdown(self._sock)
        error = TransferError(f"shm peer {self.peer!r}: {self._dead}")
        for waiter, *_ in pending.values():
            if isinstance(waiter, Batch):
                waiter.complete(error)
            elif not waiter.done():
                waiter.set_exception(error)

    def _send_loop(self) -> None:
        try:
            self._connect()
        except Exception as exc:  # OSError, HandshakeError or a bug: either way no batch may wait forever
            self.die(f"cannot connect: {exc}")
        while (job := self.jobs.get()) is not None:
            with self._gate.handling():
                self._handle(job)

    def _handle(self, job: Job) -> None:
        if job.batch.done():  # timed out while queued: its memory may be its caller's again
            return
        if self._dead is not None:
            job.batch.complete(TransferError(f"shm peer {self.peer!r}: {self._dead}"))
            return
        try:
            if job.direction is None:
                assert job.message is not None
                self._request(shm_wire.Note(0, job.message.payload), job.batch)
                return
            move = self.transport.plan(self, job)
            self._request(move, job.batch, sum(s.length for s in job.slices), move.write)
            if move.sums_follow:
                assert job.message is not None
                self._send_sums(move.id, job.message)
        except TransferError as exc:
            job.batch.complete(exc)
        except Exception as exc:  # a bug must fail this batch, not stop the thread every later one needs
            log.exception("shm sender to %s failed", self.peer)
            job.batch.complete(TransferError(f"shm sender failed: {type(exc).__name__}: {exc}"))

    def _connect(self) -> None:
        transport = self.transport
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = sock
        sock.settimeout(transport.config.connect_timeout_s)
        sock.connect("\0" + self.address)
        if transport.auth_key is not None:
            client_handshake(sock, transport.auth_key)
        hello = shm_wire.Hello(transport.local_name(), transport.probe_address, transport.probe,
                               transport.cma_reason is None)
        try:
            shm_wire.send(sock, hello)
            reply = shm_wire.recv_reply(sock)
            if reply is None:
                raise ConnectionError("closed")
        except OSError as exc:
            raise ConnectionError(f"the peer closed the connection during the hello ({exc}): it runs with "
                                  f"another cluster token, or none?") from None
        if not isinstance(reply, shm_wire.HelloReply):
            raise ConnectionError(f"shm peer answered the hello with {type(reply).__name__}")
        self.cma, self.cma_reason = reply.cma, reply.reason
        if reply.cma and transport.cma_reason is None:  # reads: may this side read the owner too?
            owner = peer_pid(sock)
            if cma.probe(owner, reply.probe_address, reply.probe) is None:
                self.pull_pid = owner
        sock.settimeout(None)
        threading.Thread(target=self._read_loop, name=f"shm-read-{self.peer}", daemon=True).start()
        self._connected = True

    def _request(self, request: Any, waiter: Batch | Future, nbytes: int = 0, write: bool = False) -> None:
        with self._lock:
            if self._dead is not None:
                raise TransferError(f"shm peer {self.peer!r}: {self._dead}")
            self._next_id += 1
            request.id = request_id = self._next_id
            self._pending[request.id] = (waiter, time.perf_counter(), nbytes, write)
        if isinstance(waiter, Batch):  # one that times out unanswered must not stay here
            waiter.add_done_callback(lambda _: self._forget_request(request_id))
        self._send(request)

    def _forget_request(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def _send(self, frame: Any) -> None:
        try:
            assert self._sock is not None
            shm_wire.send(self._sock, frame)
        except OSError as exc:
            self.die(f"control socket failed: {exc}")

    def _send_sums(self, move_id: int, message: OutgoingMessage) -> None:
        try:
            sums = shm_wire.Sums(move_id, list(message.checksums))  # waits for the engine's hashes
        except Exception as exc:  # the owner waits for this frame: it must come, failed or not
            sums = shm_wire.Sums(move_id, [], f"the sender could not hash the slices: {exc}")
        self._send(sums)

    def where(self, regions: list[str]) -> list[tuple[SegmentSpan | None, int, int]]:
        """The owner's segment span, address and length of each of `regions` (cached; asked
        once per region; the owner checks them again after each use)."""
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
            self._where.update({r: (None if s is None else SegmentSpan(*s), *base)
                                for r, s, base in zip(missing, reply.spans, reply.bases)})
        return [self._where[r] for r in regions]

    def forget_where(self, regions: list[str] | None = None) -> None:
        """Ask the owner again next time, for `regions` (None: all)."""
        if regions is None:
            self._where.clear()
        for region in regions or ():
            self._where.pop(region, None)

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
                    self.transport.count_done(nbytes, write, time.perf_counter() - started)
                else:
                    self.forget_where()  # a "done" or "pulled" move may have failed on a stale entry
                waiter.complete(error)
        except OSError as exc:
            self.die(f"control socket failed: {exc}")
            return
        self.die("closed its control socket (it exited?)")
