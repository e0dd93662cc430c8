"""messenger/rdma_verbs.py against the real pyverbs, as far as it goes without a device: the
objects it builds (QP attributes, work requests) are pyverbs' own, checked field by field; opening
a port fails with the reason. Posting, polling and registering never ran (no device here)."""

from __future__ import annotations

import socket

import pytest

from messenger.api import Direction, TransferError
from messenger.rdma_plan import QpEndpoint, RdmaConfig, WorkRequest
from messenger.rdma_verbs import (connect_attr, device_names, gid_text, gpudirect_missing, open_pyverbs_port,
                                  pyverbs_missing, send_wr)

pytestmark = pytest.mark.skipif(pyverbs_missing() is not None, reason=str(pyverbs_missing()))


def test_connect_attributes_carry_the_remote_end():
    from pyverbs import enums as e

    local = QpEndpoint(qpn=17, psn=0x123456, lid=1, gid="fe80" + "0" * 27 + "1", mtu=5)
    remote = QpEndpoint(qpn=42, psn=0xABCDEF, lid=7, gid="fe80" + "0" * 27 + "2", mtu=3)
    attr = connect_attr(RdmaConfig(port=2, gid_index=3), local, remote)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (42, 0xABCDEF, 0x123456)
    assert attr.path_mtu == 3 and attr.port_num == 2  # the smaller MTU of the two ends
    assert attr.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    assert attr.ah_attr.dlid == 7 and attr.ah_attr.port_num == 2
    assert (attr.retry_cnt, attr.rnr_retry, attr.timeout) == (7, 7, 14)


def test_work_requests_become_the_right_verbs():
    from pyverbs import enums as e

    write = send_wr(WorkRequest(Direction.WRITE, 0x1000, 5, 4096, 0x2000, 9, wr_id=11))
    last = send_wr(WorkRequest(Direction.WRITE, 0x1000, 5, 4096, 0x2000, 9, wr_id=12, imm=0x01020304))
    read = send_wr(WorkRequest(Direction.READ, 0x1000, 5, 4096, 0x2000, 9, wr_id=13))
    assert (write.opcode, last.opcode, read.opcode) == (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM,
                                                        e.IBV_WR_RDMA_READ)
    assert (write.wr_id, last.wr_id, read.wr_id) == (11, 12, 13)
    assert last.imm_data == socket.htonl(0x01020304)  # big-endian on the wire, as verbs wants it
    assert write.num_sge == 1 and write.send_flags == e.IBV_SEND_SIGNALED


def test_gid_text_is_what_pyverbs_parses():
    from pyverbs.addr import GID

    hex32 = "fe800000000000000002c9fffe0a0b0c"
    assert str(GID(gid_text(hex32))).replace(":", "") == hex32


def test_without_a_device_opening_a_port_says_so():
    try:
        names = device_names()
    except TransferError as exc:  # this kernel: the call itself fails
        assert str(exc).startswith("no RDMA device: ibv_get_device_list() failed")
        names = []
    if names:
        pytest.skip(f"this machine has RDMA devices {names}")
    with pytest.raises(TransferError, match="no RDMA device"):
        open_pyverbs_port(RdmaConfig())


def test_gpu_memory_needs_nvidia_peermem():
    import os

    loaded = os.path.isdir("/sys/module/nvidia_peermem") or os.path.isdir("/sys/kernel/mm/memory_peers/nv_mem")
    assert (gpudirect_missing() is None) == loaded
    if not loaded:
        assert "modprobe nvidia_peermem" in gpudirect_missing()
