"""The transfer engine's contract: what every transport implements and every user calls.

The messenger moves bytes between registered memory regions of two processes, one-sided in the
style of RDMA: a batch of slices (local region, offset, remote region, offset, length) is written
to (or read from) a peer, and completes as a whole. It knows nothing of KV caches, blocks or
layers: the KV path (prefill/, decode/) and the pool (store/) give it regions and slices.

Pieces:
- `Region`: a named, registered block of memory (a numpy array, a CPU tensor's storage, an mmap,
  a shared-memory segment; GPU memory by address for transports that can reach it).
- `Slice`: one contiguous copy. `Batch`: the completion handle of a list of slices.
- `PeerInfo`: what a peer publishes so others can reach it (through the registry); the engine
  picks a transport per peer (`messenger/select.py`).
- `Transport`: moves slices and messages to one kind of peer. The engine (`messenger/engine.py`)
  owns the transports, the region table, checksums, calls and notifications on top of them.

Ordering and integrity, the promises users build on:
- A notification attached to a batch is delivered to the peer's `on_notify` only after every
  slice of that batch has landed in the peer's memory and its checksum (xxh3-64 per slice,
  computed by the sender off the caller's thread, verified by the receiver) matched. A slice
  that fails verification fails the batch on both sides: the sender's `Batch.wait` raises
  `ChecksumError`; the receiver's `on_notify` gets the error, never silently bad bytes.
- A peer that dies or stops answering fails every batch in flight to it within the engine's
  `timeout_s` (a READ landing at that moment first finishes it, itself bounded: a tcp frame's
  recv by the socket's timeout); nothing waits forever.
- Once a batch has completed (whatever its error, a timeout included), no transport writes into
  its local memory any more: a READ's bytes land under `Batch.begin_landing`, and a completion
  that comes meanwhile waits for the landing to end. So a caller may reuse its buffers as soon as
  `wait` returns or raises. Exceptions, operations that cannot be recalled once posted: rdma and
  nixl READs (the NIC writes when it gets the bytes), and an shm READ the owner copies into this
  process (by process_vm_writev when this side may not read the owner by CMA, or into this
  side's shared segment when CMA is off) if that copy began before the batch's deadline. Their users must not hand
  such memory to anyone else right after a failed read (store/remote.py quarantines its slots).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

log = logging.getLogger(__name__)


class TransferError(ConnectionError):
    """A batch did not complete: the peer is unreachable, closed, timed out, or refused it."""


class ChecksumError(TransferError):
    """A slice arrived with bytes that do not match the sender's checksum."""


class TimedOut(TransferError):
    """A batch or call did not complete in time: its peer is dead, silent or too slow."""


class CallFailed(TransferError):
    """The peer answered a call with its handler's error: it is alive and reachable."""


class NoTransport(TransferError):
    """No transport both sides have can reach the peer (e.g. rdma without a device)."""


class NotifyRefused(Exception):
    """Raised by an on_notify handler: the batch's bytes landed, but this side will not use them
    (nothing expects them any more: dropped, expired, replaced). The sender's batch fails with the
    message, so the sender does not report as delivered what its receiver threw away."""


class Direction(str, Enum):
    WRITE = "write"  # local -> remote
    READ = "read"  # remote -> local


@dataclass(frozen=True)
class Slice:
    """One contiguous copy between a local and a remote region (bytes, offsets in bytes)."""

    local_region: str
    local_offset: int
    remote_region: str
    remote_offset: int
    length: int

    def __post_init__(self) -> None:
        # Plain ints on the wire: a numpy integer passes the comparisons below but fails the
        # encoder on the link's sender thread, which fails every batch in flight to that peer.
        for name in ("local_offset", "remote_offset", "length"):
            value = getattr(self, name)
            if type(value) is not int:
                try:
                    object.__setattr__(self, name, operator.index(value))
                except TypeError:
                    raise TypeError(f"bad slice {self}: {name} must be an integer, got {type(value).__name__}") from None
        if self.local_offset < 0 or self.remote_offset < 0 or self.length <= 0:
            raise ValueError(f"bad slice {self}: offsets must be >= 0 and length > 0")


@dataclass(frozen=True)
class RegionInfo:
    """A region as a peer sees it: its name and length (offsets beyond it are refused)."""

    name: str
    length: int
    device: str = "cpu"  # "cpu" or "cuda:N"; only rdma and nixl reach GPU memory


@dataclass(frozen=True)
class PeerInfo:
    """What an engine publishes so others can reach it.

    `host_id` identifies the machine (same host -> shm is possible); `transports` maps a
    transport's name to its address descriptor (tcp: "host:port", shm: a segment namespace,
    rdma: device/gid/qp info, nixl: agent metadata, all as strings); `regions` lists what a
    peer may write into or read from; `call_address` is where its calls are answered.
    """

    name: str
    host_id: str
    transports: dict[str, str]
    regions: tuple[RegionInfo, ...] = ()
    call_address: str = ""
    """Where its call lanes listen ("host:port", messenger/call_lane.py); empty: calls go
    through the transport chosen for it."""

    def region(self, name: str) -> RegionInfo | None:
        return next((r for r in self.regions if r.name == name), None)


@dataclass
class Region:
    """A registered block of local memory. `view` is a writable, byte-addressed memoryview for
    CPU memory (None for device memory, which only `address` reaches)."""

    name: str
    length: int
    address: int
    view: memoryview | None
    device: str = "cpu"

    def info(self) -> RegionInfo:
        return RegionInfo(self.name, self.length, self.device)

    def check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise TransferError(
                f"slice [{offset}, {offset + length}) is outside region {self.name!r} of {self.length} B")


# on_notify(peer_name, message, error): `error` is None when every slice of the batch the
# message rode on landed and verified; otherwise it says what failed, and the message is still
# delivered so the receiver can fail its own work at once instead of waiting for a timeout.
# A handler that raises NotifyRefused fails the sender's batch.
NotifyHandler = Callable[[str, bytes, "str | None"], None]


@dataclass
class CallReply:
    """What an on_call handler may return instead of bytes: a small `body`, then bulk bytes
    sent from the handler's own buffers (`attachment`, a list of buffers, not copied on a call
    lane); `done` runs once they are sent or the sending failed (e.g. to unpin them). The
    caller gets body and attachment as one, or with `call(..., into=...)` the attachment lands
    straight in the buffers it names."""

    body: bytes
    attachment: list = field(default_factory=list)
    done: Callable[[], None] | None = None


# on_call(peer_name, request) -> reply: a small RPC for rendezvous (e.g. "where do I write?"),
# or a block's bytes (CallReply).
CallHandler = Callable[[str, bytes], "bytes | CallReply"]
# call(..., into=): (reply body, attachment bytes) -> buffers summing to that many bytes.
AttachmentSink = Callable[[bytes, int], list]


class Batch:
    """Completion of one submitted batch. Thread-safe; completes exactly once.

    The engine hands each transport a batch of its own and ends the user's from it; its watchdog
    times out the transport's batch, so a landing in progress (`begin_landing`) holds the timeout
    back until the bytes are in: a waiter never wakes while a transport writes into its memory
    (the module's notes say which posted operations cannot be held back)."""

    def __init__(self, nbytes: int, num_slices: int):
        self.nbytes = nbytes
        self.num_slices = num_slices
        # time.monotonic() by which the engine's watchdog fails it (set by the engine before the
        # transport sees it): a same-host peer checks it before touching the initiator's memory.
        self.deadline: float | None = None
        self._done = threading.Event()
        self._error: TransferError | None = None
        self._callbacks: list[Callable[[Batch], None]] = []
        self._outcome: Callable[[TransferError | None], None] | None = None
        self._lock = threading.Lock()
        self._landings = 0  # transports writing into this batch's local memory right now
        # A completion that came during a landing, as (error,): it takes effect when they end.
        self._held: tuple[TransferError | None] | None = None

    def on_outcome(self, record: Callable[[TransferError | None], None]) -> None:
        """`record(error)` runs in the call that completes the batch, before any waiter wakes, so
        a waiter finds what it recorded (the engine's stats). Set it before the batch is submitted;
        it must be quick and must not touch this batch."""
        self._outcome = record

    def complete(self, error: TransferError | None = None) -> None:
        """Called by the transport (or the engine's timeout watchdog); later calls are ignored.
        During a landing (`begin_landing`) it is held, never blocks, and takes effect when the
        last landing ends: the first completion is still the one the batch ends with."""
        with self._lock:
            if self._done.is_set() or self._held is not None:
                return
            if self._landings:
                self._held = (error,)
                return
            callbacks = self._settle(error)
        self._run_callbacks(callbacks)

    def begin_landing(self) -> bool:
        """A transport is about to write into this batch's local memory (a READ's bytes); False:
        the batch ended or is ending, so it must write nothing. Until the matching `end_landing`
        (call it in a finally, whatever the copy raised) a completion is held, so no waiter wakes
        while bytes still land in memory its caller then takes back. A landing must itself end
        in bounded time (a socket timeout, a syscall): it delays the batch's end by that much."""
        with self._lock:
            if self._done.is_set() or self._held is not None:
                return False
            self._landings += 1
            return True

    def end_landing(self) -> None:
        """The landing `begin_landing` started is over (finished or failed); a completion held
        meanwhile takes effect now, on this thread."""
        with self._lock:
            self._landings -= 1
            if self._landings or self._held is None:
                return
            callbacks = self._settle(self._held[0])
        self._run_callbacks(callbacks)

    def _settle(self, error: TransferError | None) -> list[Callable[["Batch"], None]]:
        """End the batch with `error` (under the lock); returns the callbacks to run outside it."""
        self._error = error
        if self._outcome is not None:
            self._outcome(error)
        self._done.set()
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _run_callbacks(self, callbacks: list[Callable[["Batch"], None]]) -> None:
        for callback in callbacks:
            self._run_callback(callback)

    def _run_callback(self, callback: Callable[["Batch"], None]) -> None:
        # A failing callback is its owner's bug: it must not stop the others, nor kill the thread
        # that completed the batch (the engine's watchdog, a transport's reader).
        try:
            callback(self)
        except Exception:
            log.exception("a done-callback of a batch failed")

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> TransferError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until the batch completed; raise its error, or TransferError on timeout."""
        if not self._done.wait(timeout):
            raise TransferError(f"batch of {self.num_slices} slices not complete after {timeout} s")
        if self._error is not None:
            raise self._error

    def add_done_callback(self, callback: Callable[["Batch"], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        self._run_callback(callback)


@dataclass(frozen=True)
class OutgoingMessage:
    """A message riding on a batch: delivered after the batch's slices landed and verified."""

    payload: bytes
    checksums: tuple[int, ...] = field(default=())  # xxh3-64 per slice, in the batch's order


class Transport(Protocol):
    """One way of reaching peers. Implementations: tcp.py, shm.py, rdma.py, nixl_transport.py.

    The engine calls `start` once with its region table and inbound callbacks, then `submit`
    from any thread. A transport moves bytes and messages and reports completion; it does not
    compute checksums or time batches out (the engine does both, the same for every transport).
    Every write into a batch's local memory (a READ's bytes) happens between
    `batch.begin_landing()` (skip it when that says False) and `batch.end_landing()` in a
    finally, so nothing lands after the batch completed. rdma and nixl cannot: a READ posted to
    the NIC is not recalled when its batch times out, and the NIC may still write its bytes.
    """

    name: str

    def available(self) -> str | None:
        """None when this transport can run here; otherwise why not (e.g. "no RDMA device")."""
        ...

    def start(self, regions: "RegionTable", deliver: "InboundHandler") -> str:
        """Start serving; returns this side's address descriptor for PeerInfo.transports."""
        ...

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        """Whether this transport can move bytes between this process and `peer`."""
        ...

    def submit(self, peer: PeerInfo, direction: Direction, slices: list[Slice], batch: Batch,
               message: OutgoingMessage | None) -> None:
        """Start moving `slices`; complete `batch` when they landed on the far side (WRITE) or
        here (READ), and deliver `message` to the peer after its slices. Never blocks on the
        network in the caller's thread beyond queueing."""
        ...

    def send_message(self, peer: PeerInfo, payload: bytes, batch: Batch) -> None:
        """A message without slices (calls and their replies use it)."""
        ...

    def unregister(self, name: str) -> None:
        """The engine dropped region `name`: release what this transport holds for it (an MR, a
        NIXL registration), so it neither accumulates nor stays reachable by a peer's cached key.
        A transport that holds nothing per region does nothing."""
        ...

    def stats(self) -> dict:
        """Counters (messenger/stats.py's TransportStats.snapshot() shape)."""
        ...

    def close(self) -> None:
        ...


class RegionTable(Protocol):
    """The engine's registered regions, as transports see them (lookups by name, bounds-checked)."""

    def get(self, name: str) -> Region: ...


class InboundHandler(Protocol):
    """What a transport hands the engine when something arrives from a peer.

    `slices_landed(peer, slices, message)`: every slice of one of the peer's WRITE batches is now
    in local memory (as the sender described them: this side's memory is `remote_region` at
    `remote_offset`) and `message` (possibly None) rode on them. The engine verifies the
    message's checksums over that memory, calls the user's on_notify, and returns None or the
    error the transport sends back so the sender's batch fails. `message(peer, payload)`: a
    message without slices (calls and replies).
    """

    def slices_landed(self, peer: str, slices: list[Slice], message: OutgoingMessage | None) -> str | None: ...

    def message(self, peer: str, payload: bytes) -> None: ...
