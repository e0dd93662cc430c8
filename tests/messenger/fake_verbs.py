"""An in-process RDMA fabric with the VerbsPort / VerbsQp surface of messenger/rdma_verbs.py.

It does what a NIC does to memory, by address: an RDMA WRITE copies from a local registered
region into the peer's (ctypes.memmove), a READ the other way, a WRITE with immediate consumes
one of the peer's posted receives. It checks what a NIC checks (lkeys and rkeys against their
regions' bounds, queue-pair state, send-queue depth, receives posted) and fails with the same
completion statuses, so messenger/rdma.py runs end to end in tests without a device. It does not
model timing, packet loss, MTU, or PSNs.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import deque

from messenger.api import Direction
from messenger.rdma_plan import QpEndpoint, WorkRequest
from messenger.rdma_verbs import Completion

SUCCESS, LOC_PROT_ERR, REM_ACCESS_ERR, RETRY_EXC_ERR, RNR_RETRY_EXC_ERR = 0, 4, 9, 12, 13


class QueueFull(RuntimeError):
    """ibv_post_send's ENOMEM: more work requests than the send queue holds."""


class Fabric:
    """The wire and the NICs' key tables, shared by every FakePort of a test."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.qps: dict[int, FakeQp] = {}
        self.mrs: dict[int, tuple[int, int]] = {}  # key (lkey == rkey here) -> (address, length)
        self.dead: set[FakePort] = set()  # ports that stopped answering
        self._numbers = itertools.count(100)
        self.posted = 0  # work requests posted, all ports

    def number(self) -> int:
        return next(self._numbers)

    def inside(self, key: int, address: int, length: int) -> bool:
        region = self.mrs.get(key)
        return region is not None and region[0] <= address and address + length <= region[0] + region[1]


class FakeQp:
    def __init__(self, port: "FakePort", send_depth: int):
        self.port, self.qpn, self.send_depth = port, port.fabric.number(), send_depth
        self.remote: int | None = None
        self.receives: deque[int] = deque()
        self.outstanding = 0  # posted, completion not yet polled (what bounds a real send queue)
        self.closed = False
        port.fabric.qps[self.qpn] = self

    def connect(self, local: QpEndpoint, remote: QpEndpoint) -> None:
        assert local.qpn == self.qpn and local.lid == self.port.lid
        self.remote = remote.qpn

    def post(self, requests: list[WorkRequest]) -> None:
        fabric = self.port.fabric
        with fabric.lock:
            if self.outstanding + len(requests) > self.send_depth:
                raise QueueFull(f"{self.outstanding} outstanding + {len(requests)} > depth {self.send_depth}")
            self.outstanding += len(requests)
            fabric.posted += len(requests)
            for r in requests:
                self.port.completions.append(Completion(r.wr_id, self.qpn, self._execute(r), inbound=False))

    def _execute(self, r: WorkRequest) -> int:
        fabric = self.port.fabric
        peer = fabric.qps.get(self.remote)
        if peer is None or peer.closed or peer.port in fabric.dead or self.port in fabric.dead:
            return RETRY_EXC_ERR
        if not fabric.inside(r.lkey, r.address, r.length):
            return LOC_PROT_ERR
        if not fabric.inside(r.rkey, r.remote_address, r.length):
            return REM_ACCESS_ERR
        if r.opcode is Direction.WRITE:
            if r.imm is not None and not peer.receives:
                return RNR_RETRY_EXC_ERR
            ctypes.memmove(r.remote_address, r.address, r.length)
            if r.imm is not None:
                peer.port.completions.append(Completion(peer.receives.popleft(), peer.qpn, SUCCESS, True, r.imm))
        else:
            ctypes.memmove(r.address, r.remote_address, r.length)
        return SUCCESS

    def post_receives(self, wr_ids: list[int]) -> None:
        with self.port.fabric.lock:
            self.receives.extend(wr_ids)

    def close(self) -> None:
        self.closed = True


class FakePort:
    def __init__(self, fabric: Fabric, config, device: str = "fake0"):
        self.fabric, self.config = fabric, config
        self.device, self.port, self.lid, self.mtu = device, config.port, fabric.number(), 5
        self.gid = f"{self.lid:032x}"
        self.completions: deque[Completion] = deque()
        self.registered: list[tuple[int, int, str]] = []
        self.closed = False

    def register(self, address: int, length: int, device: str) -> tuple[int, int, object]:
        with self.fabric.lock:
            key = self.fabric.number()
            self.fabric.mrs[key] = (address, length)
        self.registered.append((address, length, device))
        return key, key, key

    def deregister(self, handle: object) -> None:
        with self.fabric.lock:
            self.fabric.mrs.pop(handle, None)

    def create_qp(self) -> FakeQp:
        return FakeQp(self, self.config.send_depth)

    def poll(self, max_entries: int) -> list[Completion]:
        with self.fabric.lock:
            out = [self.completions.popleft() for _ in range(min(max_entries, len(self.completions)))]
            for c in out:
                if not c.inbound:
                    self.fabric.qps[c.qpn].outstanding -= 1
        return out

    def close(self) -> None:
        self.closed = True
