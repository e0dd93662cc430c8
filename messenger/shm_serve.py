"""The owner's side of one shm connection (messenger/shm.py): it copies the initiator's batches
into or out of this process's regions and answers each request, in order.

Two threads per connection, a pipeline: the reading thread takes a request, copies its bytes and
reads its checksums; the replying thread hands the batch to the engine (which verifies the
checksums and runs on_notify) and sends the acknowledgement. So batch N is verified while batch
N+1 is copied, and a large stream costs about the slower of the two instead of their sum. The
queue between them is short, so a slow engine slows the initiator down instead of piling up.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from messenger import cma, shm_wire
from messenger.api import OutgoingMessage, Slice, TransferError
from messenger.handshake import HandshakeError, server_handshake
from messenger.segments import SegmentSpan

if TYPE_CHECKING:
    from messenger.shm import ShmTransport

log = logging.getLogger(__name__)

PIPELINE_DEPTH = 4  # batches copied but not yet handed to the engine, per connection


def peer_pid(sock: socket.socket) -> int:
    """The connecting process's pid in this pid namespace, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


class Served:
    """One accepted connection: `run` on its own thread until the initiator leaves."""

    def __init__(self, transport: ShmTransport, conn: socket.socket):
        self.transport, self.conn = transport, conn
        self.peer = ""
        self._pid: int | None = None  # set when the initiator passed the CMA probe
        self._replies: queue.Queue[Callable[[], shm_wire.Reply] | None] = queue.Queue(PIPELINE_DEPTH)

    def run(self) -> None:
        replier = threading.Thread(target=self._reply_loop, name="shm-reply", daemon=True)
        try:
            self._hello()
            replier.start()
            while (request := shm_wire.recv_request(self.conn)) is not None:
                if isinstance(request, shm_wire.Move):
                    self._replies.put(self._move(request))
                else:
                    self._replies.put(lambda request=request: self._answer(request))
        except (OSError, HandshakeError) as exc:
            if not self.transport.closed:
                log.debug("shm connection from %s ended: %s", self.peer or "?", exc)
        except Exception:  # a bug: close this connection (its sender's batches fail), keep serving others
            log.exception("shm connection from %s failed", self.peer or "?")
        finally:
            if replier.is_alive():
                self._replies.put(None)
                replier.join()
            self.conn.close()

    def _hello(self) -> None:
        transport, conn = self.transport, self.conn
        pid = peer_pid(conn)
        conn.settimeout(transport.config.connect_timeout_s)  # a silent stranger cannot hold a thread
        if transport.auth_key is not None:
            server_handshake(conn, transport.auth_key)
        hello = shm_wire.recv_request(conn)
        if not isinstance(hello, shm_wire.Hello):
            raise ConnectionError(f"expected hello, got {type(hello).__name__}")
        reason = (transport.cma_reason or ("the peer disabled it" if not hello.cma else None)
                  or cma.probe(pid, hello.probe_address, hello.probe))
        shm_wire.send(conn, shm_wire.HelloReply(transport.local_name(), reason is None, reason,
                                                transport.probe_address, transport.probe))
        conn.settimeout(None)
        self.peer, self._pid = hello.name, pid if reason is None else None

    def _reply_loop(self) -> None:
        broken = False
        while (job := self._replies.get()) is not None:
            reply = job()  # runs even when the socket broke: the engine still hears of the batch
            if broken:
                continue
            try:
                shm_wire.send(self.conn, reply)
            except OSError:
                broken = True

    def _answer(self, request: shm_wire.Request) -> shm_wire.Reply:
        """The reply to a request without slices."""
        transport = self.transport
        request_id = getattr(request, "id", -1)
        try:
            if isinstance(request, shm_wire.Where):
                regions = [transport.region(name, 0, 0) for name in request.regions]
                spans = [transport.span(r, 0) for r in regions]
                return shm_wire.WhereReply(request_id, [None if s is None else (s.name, s.offset) for s in spans],
                                           bases=[(r.address, r.length) for r in regions])
            if isinstance(request, shm_wire.Note):
                transport.deliver.message(self.peer, request.payload)
                return shm_wire.Ack(request_id)
            raise TransferError(f"unexpected {type(request).__name__}")
        except TransferError as exc:
            return (shm_wire.WhereReply(request_id, [], str(exc)) if isinstance(request, shm_wire.Where)
                    else shm_wire.Ack(request_id, str(exc)))
        except Exception as exc:  # the engine's handler failed: the peer must get an answer, never a hang
            log.exception("shm inbound message handler failed")
            return shm_wire.Ack(request_id, f"{type(exc).__name__}: {exc}")

    def _move(self, move: shm_wire.Move) -> Callable[[], shm_wire.Ack]:
        """Copy one batch and read its checksums (this thread); returns what hands it to the
        engine and makes its Ack (the replying thread). Raises ConnectionError when the
        initiator left before its checksums came."""
        error = None
        slices: list[Slice] = []
        try:
            slices = [Slice(*t) for t in move.slices]
            if move.deadline and time.monotonic() > move.deadline:
                raise TransferError("the initiator's batch timed out before this side copied it")
            self._land(move, slices)
        except (TransferError, OSError, ValueError) as exc:
            error = f"shm {'write' if move.write else 'read'} refused by {self.transport.local_name()}: {exc}"
        sums = None
        if move.sums_follow:  # read it even after a failure: the connection goes on
            sums = shm_wire.recv_request(self.conn)
            if not isinstance(sums, shm_wire.Sums) or sums.id != move.id:
                self._lost(move, error or "the sender left before the batch's checksums came")
                raise ConnectionError(f"expected the checksums of batch {move.id}, got {type(sums).__name__}")
            error = error or sums.error
        checksums = () if sums is None else tuple(sums.checksums)
        return lambda: self._landed(move, slices, checksums, error)

    def _landed(self, move: shm_wire.Move, slices: list[Slice], checksums: tuple[int, ...],
                error: str | None) -> shm_wire.Ack:
        if error is not None:
            self._lost(move, error)
            return shm_wire.Ack(move.id, error)
        if not move.write:
            return shm_wire.Ack(move.id)
        message = None if move.message is None else OutgoingMessage(move.message, checksums)
        try:
            error = self.transport.deliver.slices_landed(self.peer, slices, message)
        except Exception as exc:  # the engine's handler failed: the peer must get an answer, never a hang
            log.exception("shm inbound batch handler failed")
            return shm_wire.Ack(move.id, f"{type(exc).__name__}: {exc}")
        # The engine verifies checksums; its error text is the only sign of which failure it was.
        return shm_wire.Ack(move.id, error, error is not None and "checksum" in error.lower())

    def _lost(self, move: shm_wire.Move, error: str) -> None:
        """Tell the engine at once that an inbound write with a message failed (its on_notify
        hears it now, not at a timeout): the engine's optional `batch_failed` hook."""
        hook = getattr(self.transport.deliver, "batch_failed", None)
        if move.write and move.message is not None and hook is not None:
            try:
                hook(self.peer, OutgoingMessage(move.message), error)
            except Exception:
                log.exception("shm batch_failed handler failed")

    def _land(self, move: shm_wire.Move, slices: list[Slice]) -> None:
        """Copy `move`'s bytes between this side's regions and the initiator, or check the
        initiator's own copy ("done"). Raises TransferError (or OSError from a copy)."""
        transport = self.transport
        regions = [transport.region(s.remote_region, s.remote_offset, s.length) for s in slices]
        own = [r.address + s.remote_offset for r, s in zip(regions, slices)]
        if move.mode == "cma":
            if self._pid is None or len(move.addresses) != len(slices):
                raise TransferError("a cma move on a connection without cma")
            # The initiator's write is this side's read from it, and the other way round.
            transport.copy([(o, a, s.length) for o, a, s in zip(own, move.addresses, slices)],
                           write=not move.write, pid=self._pid)
        elif move.mode == "mapped" and len(move.spans) == len(slices):
            theirs = [transport.segments.address(SegmentSpan(*span), s.length) for span, s in zip(move.spans, slices)]
            transport.copy([(o, t, s.length) for o, t, s in zip(own, theirs, slices)], write=not move.write, pid=None)
        elif move.mode == "pulled" and not move.write and len(move.addresses) == len(slices):
            for address, s in zip(move.addresses, own):
                if address != s:  # the initiator read where this region no longer is
                    raise TransferError("a region moved while the peer read it: read again")
        elif move.mode == "done" and len(move.spans) == len(slices):
            for r, s, span in zip(regions, slices, move.spans):
                if transport.span(r, s.remote_offset) != SegmentSpan(*span):
                    raise TransferError(f"region {r.name!r} is no longer in segment {span[0]!r}")
        else:
            raise TransferError(f"bad move mode {move.mode!r}")
        nbytes = sum(s.length for s in slices)
        transport.count_served(nbytes, move.write)
