"""The only code of the rdma transport that touches a device: a thin shell over pyverbs.

NEVER RUN: the machines this project was built on have no RDMA device (no InfiniBand, no
soft-RoCE: the kernel lacks it), so everything below past `available()` was written against
pyverbs' documented API (rdma-core 44) and checked only by import. messenger/rdma.py drives it
through the small `VerbsPort` / `VerbsQp` surface that tests/messenger/fake_verbs.py also
implements, so all logic around it runs in tests.

pyverbs comes from Debian's python3-pyverbs (the Makefile's `rdma-tools` target links it into
the virtualenv); PyPI's pyverbs builds but does not load against Debian's libibverbs 44.
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from typing import Protocol

from messenger.api import Direction, TransferError
from messenger.rdma_plan import RECV_TAG, QpEndpoint, RdmaConfig, WorkRequest


@dataclass(frozen=True)
class Completion:
    """One work completion, as the transport needs it."""

    wr_id: int
    qpn: int
    status: int  # 0: IBV_WC_SUCCESS
    inbound: bool  # a receive (a peer's WRITE with immediate), not one of our own requests
    imm: int | None = None
    vendor_err: int = 0


class VerbsQp(Protocol):
    qpn: int

    def connect(self, local: QpEndpoint, remote: QpEndpoint) -> None: ...  # INIT -> RTR -> RTS
    def post(self, requests: list[WorkRequest]) -> None: ...
    def post_receives(self, wr_ids: list[int]) -> None: ...
    def close(self) -> None: ...


class VerbsPort(Protocol):
    """An opened device port with one protection domain and one completion queue."""

    device: str
    port: int
    lid: int
    gid: str
    mtu: int

    def register(self, address: int, length: int, device: str) -> tuple[int, int, object]: ...  # lkey, rkey, handle
    def deregister(self, handle: object) -> None: ...
    def create_qp(self) -> VerbsQp: ...
    def poll(self, max_entries: int) -> list[Completion]: ...
    def close(self) -> None: ...


def pyverbs_missing() -> str | None:
    try:
        import pyverbs.device  # noqa: F401
    except ImportError as exc:
        return f"pyverbs not importable: {exc} (install Debian's python3-pyverbs: make rdma-tools)"
    return None


def device_names() -> list[str]:
    """The names ibv_get_device_list() returns. Raises TransferError when the call fails (as it
    does on a kernel without RDMA support)."""
    from pyverbs.device import get_device_list
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]
    except PyverbsError as exc:
        raise TransferError(f"no RDMA device: ibv_get_device_list() failed ({exc})") from exc


def gpudirect_missing() -> str | None:
    """Why GPU memory cannot be registered with the NIC here (None when nvidia_peermem is loaded)."""
    if os.path.isdir("/sys/module/nvidia_peermem") or os.path.isdir("/sys/kernel/mm/memory_peers/nv_mem"):
        return None
    return "GPUDirect RDMA needs the nvidia_peermem kernel module (modprobe nvidia_peermem); it is not loaded"


def gid_text(hex32: str) -> str:
    """32 hex digits -> the colon form pyverbs' GID takes."""
    return ":".join(hex32[i:i + 4] for i in range(0, 32, 4))


def connect_attr(config: RdmaConfig, local: QpEndpoint, remote: QpEndpoint):
    """The QPAttr that moves an RC queue pair INIT -> RTR -> RTS towards `remote` (one object for
    the three transitions; pyverbs passes each the attribute mask it needs)."""
    from pyverbs import enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr()
    attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    attr.pkey_index, attr.port_num = 0, config.port
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num, attr.rq_psn = remote.qpn, remote.psn
    attr.max_dest_rd_atomic, attr.min_rnr_timer = 16, 12
    route = GlobalRoute(dgid=GID(gid_text(remote.gid)), sgid_index=config.gid_index)
    attr.ah_attr = AHAttr(gr=route, is_global=1, dlid=remote.lid, port_num=config.port)
    # timeout 14: 4.096 us * 2^14 = 67 ms a try, 7 tries: a dead peer fails a request in about 0.5 s
    attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.max_rd_atomic = local.psn, 14, 7, 7, 16
    return attr


def send_wr(r: WorkRequest):
    """The pyverbs SendWR of one planned work request (always signaled: each completion gives one
    send-queue slot back to rdma_plan.SendQueue)."""
    from pyverbs import enums as e
    from pyverbs.wr import SGE, SendWR

    if r.opcode is Direction.READ:
        opcode = e.IBV_WR_RDMA_READ
    else:
        opcode = e.IBV_WR_RDMA_WRITE if r.imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM
    wr = SendWR(wr_id=r.wr_id, opcode=opcode, num_sge=1, sg=[SGE(r.address, r.length, r.lkey)],
                send_flags=e.IBV_SEND_SIGNALED, imm_data=socket.htonl(r.imm or 0))
    wr.set_wr_rdma(r.rkey, r.remote_address)
    return wr


class PyverbsQp:
    def __init__(self, port: "PyverbsPort"):
        from pyverbs import enums as e
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self._port = port
        cap = QPCap(max_send_wr=port.config.send_depth, max_recv_wr=port.config.recv_depth,
                    max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=port.cq, rcq=port.cq, cap=cap, sq_sig_all=1)
        self._qp = QP(port.pd, init)
        self.qpn = self._qp.qp_num

    def connect(self, local: QpEndpoint, remote: QpEndpoint) -> None:
        attr = connect_attr(self._port.config, local, remote)
        self._qp.to_init(attr)
        self._qp.to_rtr(attr)
        self._qp.to_rts(attr)

    def post(self, requests: list[WorkRequest]) -> None:
        for r in requests:
            self._qp.post_send(send_wr(r))

    def post_receives(self, wr_ids: list[int]) -> None:
        from pyverbs.wr import RecvWR

        for wr_id in wr_ids:  # a WRITE with immediate consumes a receive but needs no buffer
            self._qp.post_recv(RecvWR(wr_id=wr_id, num_sge=0))

    def close(self) -> None:
        self._qp.close()


class PyverbsPort:
    def __init__(self, config: RdmaConfig):
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD

        from pyverbs import enums as e

        names = device_names()
        if not names:
            raise TransferError("no RDMA device: ibv_get_device_list() is empty")
        name = config.device or names[0]
        if name not in names:
            raise TransferError(f"no RDMA device {name!r} (devices here: {', '.join(names)})")
        self.config, self._e = config, e
        self.ctx = Context(name=name)
        attr = self.ctx.query_port(config.port)
        if attr.state != e.IBV_PORT_ACTIVE:
            raise TransferError(f"RDMA port {name}:{config.port} is not active (state {attr.state})")
        self.device, self.port, self.lid, self.mtu = name, config.port, attr.lid, attr.active_mtu
        self.gid = str(self.ctx.query_gid(config.port, config.gid_index)).replace(":", "")
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 4 * (config.send_depth + config.recv_depth))

    def register(self, address: int, length: int, device: str) -> tuple[int, int, object]:
        from pyverbs.mr import MR

        if device != "cpu" and (why := gpudirect_missing()):
            raise TransferError(f"cannot register {device} memory for rdma: {why}")
        e = self._e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        mr = MR(self.pd, length, access, address=address)
        return mr.lkey, mr.rkey, mr

    def deregister(self, handle: object) -> None:
        handle.close()

    def create_qp(self) -> PyverbsQp:
        return PyverbsQp(self)

    def poll(self, max_entries: int) -> list[Completion]:
        e = self._e
        _, wcs = self.cq.poll(max_entries)
        # a failed completion's opcode is undefined: receives are told apart by their wr_id tag
        return [Completion(wc.wr_id, wc.qp_num, wc.status, bool(wc.wr_id & RECV_TAG),
                           socket.ntohl(wc.imm_data) if wc.status == 0 and wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM
                           else None, wc.vendor_err) for wc in wcs]

    def close(self) -> None:
        for resource in (self.cq, self.pd, self.ctx):
            resource.close()


def open_pyverbs_port(config: RdmaConfig) -> VerbsPort:
    """Open the configured device port. Raises TransferError saying why it cannot."""
    if why := pyverbs_missing():
        raise TransferError(why)
    return PyverbsPort(config)


def new_psn() -> int:
    return random.getrandbits(24)
