"""The rdma transport's pure core: what to post, in what order, and what a completion means.

Nothing here touches a device (messenger/rdma_verbs.py does); everything here runs and is tested
on any machine. The pieces:
- `RdmaConfig`: the transport's own settings (device, port, GID index, queue depths, the
  largest single work request).
- `PortAddress` / `QpEndpoint`: what a side publishes in PeerInfo (its port's identity and the
  address of its control channel) and what two sides exchange to connect one RC queue pair.
- `RkeyTable`: a peer's registered regions (address, length, rkey), bounds-checked lookups.
- `plan_work_requests`: a batch's slices -> work requests, each at most `max_message_bytes`
  (a NIC's max_msg_sz is 1-2 GiB; smaller requests also interleave batches fairly).
- `SendQueue`: flow control per queue pair: at most `depth` work requests outstanding, and at
  most `receives` WRITEs with immediate not yet acknowledged (each consumes one of the peer's
  posted receives; one more would fail with receiver-not-ready); the rest wait in order.
- `BatchBook`: which batch each work request belongs to, and when a batch is done (its last
  request completed, and, when a message rode on it, the peer acknowledged it).
- `describe_completion_error`: a work completion's status -> a sentence saying what happened.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from messenger.api import Batch, Direction, Slice, TransferError


RECV_TAG = 1 << 62
"""Set in the wr_id of every receive request, so a completion says which queue it came from even
when it failed (a failed completion's opcode is undefined)."""


RDMA_DEVICE_ENV = "MOONCAKE_RDMA_DEVICE"
RDMA_PORT_ENV = "MOONCAKE_RDMA_PORT"
RDMA_GID_INDEX_ENV = "MOONCAKE_RDMA_GID_INDEX"


@dataclass(frozen=True)
class RdmaConfig:
    """Settings of the rdma transport (the engine's EngineConfig holds what every transport shares)."""

    device: str | None = None  # an ibv device name ("mlx5_0"); None: the first one listed
    port: int = 1  # the device's port number (ports count from 1)
    gid_index: int = 0  # the GID table entry to route by; RoCE v2 usually needs 1 or 3
    send_depth: int = 256  # work requests outstanding per queue pair (send-queue flow control)
    recv_depth: int = 64  # receive requests posted per queue pair = messages in flight per peer
    max_message_bytes: int = 1 << 30  # the largest single RDMA WRITE / READ; longer slices are split
    control_host: str = "0.0.0.0"  # where the control channel (QP exchange, notices, acks) listens
    poll_idle_s: float = 0.0002  # the completion thread's sleep when a poll found nothing

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RdmaConfig":
        """The defaults, with MOONCAKE_RDMA_DEVICE, MOONCAKE_RDMA_PORT and MOONCAKE_RDMA_GID_INDEX
        where set: how an operator points a worker's KV path and pool at their NIC and GID (the
        workers read them; docs/ARCHITECTURE.md, KV path)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        if env.get(RDMA_DEVICE_ENV, "").strip():
            values["device"] = env[RDMA_DEVICE_ENV].strip()
        for name, field_name in ((RDMA_PORT_ENV, "port"), (RDMA_GID_INDEX_ENV, "gid_index")):
            raw = env.get(name, "").strip()
            if raw:
                try:
                    values[field_name] = int(raw)
                except ValueError:
                    raise ValueError(f"{name}={raw!r}: not a whole number") from None
        return cls(**values)

    def __post_init__(self) -> None:
        if self.port < 1:
            raise ValueError(f"rdma port must be >= 1 (ports count from 1), got {self.port}")
        if self.gid_index < 0:
            raise ValueError(f"rdma gid_index must be >= 0, got {self.gid_index}")
        if self.send_depth < 1 or self.recv_depth < 1:
            raise ValueError(f"rdma queue depths must be >= 1, got send {self.send_depth}, recv {self.recv_depth}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"rdma max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.poll_idle_s < 0:
            raise ValueError(f"rdma poll_idle_s must be >= 0, got {self.poll_idle_s}")


class PortAddress(msgspec.Struct, frozen=True):
    """This side's descriptor in PeerInfo.transports["rdma"] (JSON): the port it sends from and
    the TCP address of its control channel, where peers connect queue pairs."""

    device: str
    port: int
    lid: int
    gid: str  # 32 hex digits; all zeros on InfiniBand without a GRH
    mtu: int  # the port's active MTU enum value (IBV_MTU_*)
    control: str  # "host:port"

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @staticmethod
    def decode(text: str) -> "PortAddress":
        try:
            address = msgspec.json.decode(text, type=PortAddress)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise TransferError(f"bad rdma address descriptor {text!r}: {exc}") from exc
        if len(address.gid) != 32 or any(c not in "0123456789abcdef" for c in address.gid):
            raise TransferError(f"bad rdma address descriptor {text!r}: gid must be 32 lowercase hex digits")
        host, _, port = address.control.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"bad rdma address descriptor {text!r}: control must be host:port")
        return address

    def control_address(self) -> tuple[str, int]:
        host, _, port = self.control.rpartition(":")
        return host, int(port)


class QpEndpoint(msgspec.Struct, frozen=True):
    """One end of an RC queue pair, as the other end needs it for INIT -> RTR -> RTS."""

    qpn: int
    psn: int  # 24 bits
    lid: int
    gid: str
    mtu: int


class RemoteRegion(msgspec.Struct, frozen=True):
    """A peer's registered region: where it lies in the peer's address space and its rkey."""

    name: str
    address: int
    length: int
    rkey: int


class RkeyTable:
    """The regions of one peer this side may write into or read from (thread-safe)."""

    def __init__(self, regions: Iterable[RemoteRegion] = ()):
        self._lock = threading.Lock()
        self._regions: dict[str, RemoteRegion] = {}
        self.update(regions)

    def update(self, regions: Iterable[RemoteRegion]) -> None:
        with self._lock:
            for region in regions:
                self._regions[region.name] = region

    def clear(self) -> None:
        """Forget every region: the peer may have dropped or moved some (asked for again on use)."""
        with self._lock:
            self._regions.clear()

    def missing(self, names: Iterable[str]) -> list[str]:
        with self._lock:
            return sorted({n for n in names if n not in self._regions})

    def resolve(self, name: str, offset: int, length: int) -> tuple[int, int]:
        """(remote address, rkey) of [offset, offset + length) in region `name`."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise TransferError(f"the peer has no registered region {name!r}")
        if offset < 0 or offset + length > region.length:
            raise TransferError(
                f"slice [{offset}, {offset + length}) is outside the peer's region {name!r} of {region.length} B")
        return region.address + offset, region.rkey


@dataclass(frozen=True)
class LocalKey:
    """A local registered region as a work request needs it."""

    address: int
    length: int
    lkey: int


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA WRITE or READ: `length` bytes between local `address` and `remote_address`."""

    opcode: Direction
    address: int
    lkey: int
    length: int
    remote_address: int
    rkey: int
    wr_id: int = 0
    imm: int | None = None  # set on the last WRITE of a batch that carries a message


def plan_work_requests(direction: Direction, slices: list[Slice], local: Callable[[str], LocalKey],
                       remote: RkeyTable, max_message_bytes: int) -> list[WorkRequest]:
    """The work requests that move `slices`, in order, none longer than `max_message_bytes`.
    Raises TransferError (before anything is posted) if a slice is outside a region."""
    requests = []
    for s in slices:
        key = local(s.local_region)
        if s.local_offset + s.length > key.length:
            raise TransferError(
                f"slice [{s.local_offset}, {s.local_offset + s.length}) is outside region "
                f"{s.local_region!r} of {key.length} B")
        remote_address, rkey = remote.resolve(s.remote_region, s.remote_offset, s.length)
        for start in range(0, s.length, max_message_bytes):
            n = min(max_message_bytes, s.length - start)
            requests.append(WorkRequest(direction, key.address + s.local_offset + start, key.lkey, n,
                                        remote_address + start, rkey))
    return requests


class SendQueue:
    """Flow control of one queue pair: at most `depth` work requests posted and not yet completed,
    and at most `receives` WRITEs with immediate posted and not yet acknowledged by the peer (it
    reposts the receive before it acknowledges). Not thread-safe by itself: the transport holds
    its link lock around it."""

    def __init__(self, depth: int, receives: int):
        self.depth = depth
        self.receives = receives  # the peer's receives this side may still consume
        self.outstanding = 0
        self._waiting: deque[WorkRequest] = deque()

    def enqueue(self, requests: Iterable[WorkRequest]) -> list[WorkRequest]:
        """Queue `requests` behind any already waiting; returns those to post now."""
        self._waiting.extend(requests)
        return self._release()

    def completed(self, n: int = 1) -> list[WorkRequest]:
        """`n` posted requests completed; returns the waiting ones that may be posted now."""
        if n > self.outstanding:
            raise RuntimeError(f"{n} completions for {self.outstanding} outstanding work requests")
        self.outstanding -= n
        return self._release()

    def acked(self) -> list[WorkRequest]:
        """The peer acknowledged a batch that carried an immediate: one receive is back."""
        self.receives += 1
        return self._release()

    def drain(self) -> list[WorkRequest]:
        """Everything still waiting (never posted), removed: what fails when the peer is lost."""
        waiting, self._waiting = list(self._waiting), deque()
        return waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _release(self) -> list[WorkRequest]:
        ready = []
        while self._waiting and self.outstanding < self.depth:
            if self._waiting[0].imm is not None:
                if self.receives == 0:
                    break  # everything behind it waits too: the order of a batch's requests is kept
                self.receives -= 1
            ready.append(self._waiting.popleft())
            self.outstanding += 1
        return ready


@dataclass
class _Pending:
    batch: Batch
    peer: str
    remaining: int  # work requests not yet completed
    awaits_ack: bool  # a message rode on it: done only when the peer acknowledged it
    acked: bool = False
    wr_ids: list[int] = field(default_factory=list)


@dataclass
class BatchBook:
    """Which batch each work request belongs to; completes batches (thread-safe).

    Sequence numbers are 32 bits because they travel as a WRITE's immediate data.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pending: dict[int, _Pending] = field(default_factory=dict)
    _owner: dict[int, tuple[int, WorkRequest]] = field(default_factory=dict)  # wr_id -> (batch seq, request)
    _seq: itertools.count = field(default_factory=lambda: itertools.count(1))
    _wr: itertools.count = field(default_factory=lambda: itertools.count(1))

    def open(self, peer: str, batch: Batch, requests: list[WorkRequest], awaits_ack: bool) -> tuple[int, list[WorkRequest]]:
        """Number the batch and its requests (wr_id set; the last WRITE gets the seq as `imm` when
        a message rides on it). Returns (seq, numbered requests)."""
        with self._lock:
            seq = next(self._seq) & 0xFFFFFFFF
            numbered = []
            for i, r in enumerate(requests):
                imm = seq if awaits_ack and i == len(requests) - 1 and r.opcode is Direction.WRITE else None
                wr = WorkRequest(r.opcode, r.address, r.lkey, r.length, r.remote_address, r.rkey, next(self._wr), imm)
                self._owner[wr.wr_id] = (seq, wr)
                numbered.append(wr)
            self._pending[seq] = _Pending(batch, peer, len(numbered), awaits_ack, wr_ids=[r.wr_id for r in numbered])
        return seq, numbered

    def request_done(self, wr_id: int, error: TransferError | None = None,
                     counted: Callable[[WorkRequest], None] | None = None) -> tuple[Batch | None, WorkRequest | None]:
        """A work request completed. Returns (its batch if that is now complete, the request;
        None for a request whose batch already ended: timed out, failed, peer lost). `counted`
        gets the request before its batch can complete (it runs under the book's lock: it must be
        quick and take no lock but its own), so whoever waited on the batch finds it counted."""
        with self._lock:
            seq, request = self._owner.pop(wr_id, (None, None))
            entry = self._pending.get(seq) if seq is not None else None
            if entry is None:
                return None, None
            if counted is not None:  # under the lock: the peer's ack (acked) may end the batch next
                counted(request)
            entry.remaining -= 1
            if error is None and (entry.remaining > 0 or (entry.awaits_ack and not entry.acked)):
                return None, request
            self._forget(seq)
        entry.batch.complete(error)
        return entry.batch, request

    def acked(self, seq: int, error: str | None) -> Batch | None:
        """The peer acknowledged batch `seq` (error: what its verification found)."""
        with self._lock:
            entry = self._pending.get(seq)
            if entry is None:
                return None
            entry.acked = True
            if error is None and entry.remaining > 0:
                return None
            self._forget(seq)
        entry.batch.complete(TransferError(f"peer {entry.peer!r} refused the batch: {error}") if error else None)
        return entry.batch

    def fail_peer(self, peer: str, reason: str) -> int:
        """Fail every batch in flight to `peer`; returns how many."""
        with self._lock:
            seqs = [seq for seq, e in self._pending.items() if e.peer == peer]
            entries = [self._pending[seq] for seq in seqs]
            for seq in seqs:
                self._forget(seq)
        for entry in entries:
            entry.batch.complete(TransferError(reason))
        return len(entries)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def _forget(self, seq: int) -> None:
        entry = self._pending.pop(seq, None)
        for wr_id in entry.wr_ids if entry else ():
            self._owner.pop(wr_id, None)


# ibv_wc_status values (verbs.h) and what they mean for a batch; the numbers are the ABI.
_WC_STATUS = {
    1: ("IBV_WC_LOC_LEN_ERR", "a local length was wrong"),
    2: ("IBV_WC_LOC_QP_OP_ERR", "the local queue pair refused the request"),
    4: ("IBV_WC_LOC_PROT_ERR", "a local buffer is not inside a registered region"),
    5: ("IBV_WC_WR_FLUSH_ERR", "the queue pair went to the error state; the request was flushed"),
    8: ("IBV_WC_REM_INV_REQ_ERR", "the peer refused the request as invalid"),
    9: ("IBV_WC_REM_ACCESS_ERR", "the peer refused access: wrong rkey, or outside its region"),
    10: ("IBV_WC_REM_OP_ERR", "the peer could not complete the operation"),
    12: ("IBV_WC_RETRY_EXC_ERR", "the peer did not answer (transport retries exceeded): down or unreachable"),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "the peer had no receive posted (receiver-not-ready retries exceeded)"),
    19: ("IBV_WC_FATAL_ERR", "the device reported a fatal error"),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "the peer's response timed out"),
    21: ("IBV_WC_GENERAL_ERR", "the device reported a general error"),
}


def describe_completion_error(status: int, vendor_err: int = 0) -> str:
    """A sentence for a failed work completion (status != IBV_WC_SUCCESS)."""
    name, meaning = _WC_STATUS.get(status, (f"ibv_wc_status {status}", "the device reported an error"))
    vendor = f", vendor error {vendor_err:#x}" if vendor_err else ""
    return f"rdma work request failed: {meaning} ({name}{vendor})"
