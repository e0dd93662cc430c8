"""The rdma transport's pure core (messenger/rdma_plan.py) and control framing (rdma_control.py)."""

from __future__ import annotations

import socket
import struct

import pytest

from messenger import rdma_control as ctl
from messenger.api import Batch, Direction, Slice, TransferError
from messenger.rdma_plan import (BatchBook, LocalKey, PortAddress, QpEndpoint, RdmaConfig, RemoteRegion, RkeyTable,
                                 SendQueue, WorkRequest, describe_completion_error, plan_work_requests)


@pytest.mark.parametrize("field, value", [("port", 0), ("gid_index", -1), ("send_depth", 0), ("recv_depth", 0),
                                          ("max_message_bytes", 100), ("poll_idle_s", -1.0)])
def test_config_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        RdmaConfig(**{field: value})


def test_port_address_round_trips_and_refuses_garbage():
    address = PortAddress("mlx5_0", 1, 7, "fe80" + "0" * 28, 5, "10.0.0.2:4791")
    assert PortAddress.decode(address.encode()) == address
    assert address.control_address() == ("10.0.0.2", 4791)
    for bad in ["", "{}", address.encode().replace("fe80", "FE80"), address.encode().replace(":4791", ""),
                address.encode().replace('"port":1', '"port":"one"')]:
        with pytest.raises(TransferError, match="bad rdma address"):
            PortAddress.decode(bad)


def test_rkey_table_resolves_inside_regions_only():
    table = RkeyTable([RemoteRegion("kv", 0x10000, 4096, 77)])
    assert table.resolve("kv", 100, 50) == (0x10000 + 100, 77)
    assert table.resolve("kv", 0, 4096) == (0x10000, 77)
    with pytest.raises(TransferError, match="outside the peer's region 'kv'"):
        table.resolve("kv", 4000, 97)
    with pytest.raises(TransferError, match="no registered region 'other'"):
        table.resolve("other", 0, 1)
    assert table.missing(["kv", "other", "b"]) == ["b", "other"]
    table.update([RemoteRegion("kv", 0x20000, 8192, 78)])  # re-registered elsewhere: the new one wins
    assert table.resolve("kv", 4096, 1) == (0x21000, 78)


def _keys(name):
    return {"a": LocalKey(0x1000, 1 << 20, 5), "b": LocalKey(0x900000, 4096, 6)}[name]


def test_plan_splits_slices_above_the_largest_message():
    remote = RkeyTable([RemoteRegion("r", 0x50000000, 1 << 20, 9)])
    slices = [Slice("a", 100, "r", 200, 10_000), Slice("b", 0, "r", 0, 4096)]
    plan = plan_work_requests(Direction.WRITE, slices, _keys, remote, max_message_bytes=4096)
    assert [(w.address, w.length, w.remote_address) for w in plan] == [
        (0x1000 + 100, 4096, 0x50000000 + 200), (0x1000 + 100 + 4096, 4096, 0x50000000 + 200 + 4096),
        (0x1000 + 100 + 8192, 10_000 - 8192, 0x50000000 + 200 + 8192), (0x900000, 4096, 0x50000000)]
    assert [(w.lkey, w.rkey, w.opcode) for w in plan] == [(5, 9, Direction.WRITE)] * 3 + [(6, 9, Direction.WRITE)]
    assert sum(w.length for w in plan) == sum(s.length for s in slices)


def test_plan_refuses_out_of_bounds_before_anything_is_posted():
    remote = RkeyTable([RemoteRegion("r", 0, 1000, 9)])
    with pytest.raises(TransferError, match="outside region 'b'"):
        plan_work_requests(Direction.READ, [Slice("b", 4000, "r", 0, 97)], _keys, remote, 4096)
    with pytest.raises(TransferError, match="outside the peer's region 'r'"):
        plan_work_requests(Direction.READ, [Slice("a", 0, "r", 999, 2)], _keys, remote, 4096)


def _requests(n, opcode=Direction.WRITE):
    return [WorkRequest(opcode, 0x1000 + i, 1, 1, 0x2000 + i, 2) for i in range(n)]


def test_send_queue_posts_at_most_depth_in_order():
    queue = SendQueue(depth=3, receives=10)
    first = queue.enqueue(_requests(5))
    assert [r.address for r in first] == [0x1000, 0x1001, 0x1002]
    assert queue.outstanding == 3 and queue.waiting == 2
    assert [r.address for r in queue.completed(1)] == [0x1003]
    assert queue.enqueue(_requests(1)) == []  # queued behind the one still waiting: order kept
    assert [r.address for r in queue.completed(2)] == [0x1004, 0x1000]
    assert queue.outstanding == 3 and queue.waiting == 0
    with pytest.raises(RuntimeError, match="4 completions for 3 outstanding"):
        queue.completed(4)
    queue.enqueue(_requests(2))
    assert len(queue.drain()) == 2 and queue.waiting == 0


def test_send_queue_holds_immediates_until_the_peer_has_a_receive_for_them():
    queue = SendQueue(depth=10, receives=1)
    first, second = _requests(2), _requests(2)
    first[1] = WorkRequest(Direction.WRITE, 1, 1, 1, 1, 1, wr_id=1, imm=1)
    second[1] = WorkRequest(Direction.WRITE, 2, 1, 1, 2, 1, wr_id=2, imm=2)
    assert queue.enqueue(first) == first
    assert queue.enqueue(second) == second[:1]  # its immediate would find no receive posted
    assert queue.completed(3) == []  # completions free the send queue, not the peer's receives
    assert queue.acked() == second[1:]
    assert queue.receives == 0


def test_batch_completes_after_its_last_request():
    book = BatchBook()
    batch = Batch(3, 3)
    seq, numbered = book.open("p", batch, _requests(3), awaits_ack=False)
    assert all(r.imm is None for r in numbered) and len({r.wr_id for r in numbered}) == 3
    assert book.request_done(numbered[0].wr_id) == (None, numbered[0])
    assert book.request_done(numbered[2].wr_id) == (None, numbered[2])
    assert not batch.done()
    assert book.request_done(numbered[1].wr_id) == (batch, numbered[1])
    batch.wait(0)
    assert book.in_flight() == 0
    assert book.request_done(numbered[1].wr_id) == (None, None)  # a stray completion is ignored


@pytest.mark.parametrize("ack_first", [True, False])
def test_batch_with_a_message_waits_for_the_peer_ack(ack_first):
    book = BatchBook()
    batch = Batch(2, 2)
    seq, numbered = book.open("p", batch, _requests(2), awaits_ack=True)
    assert [r.imm for r in numbered] == [None, seq]  # the immediate rides on the last WRITE only
    book.request_done(numbered[0].wr_id)
    if ack_first:
        assert book.acked(seq, None) is None
        assert book.request_done(numbered[1].wr_id)[0] is batch
    else:
        assert book.request_done(numbered[1].wr_id) == (None, numbered[1])
        assert book.acked(seq, None) is batch
    batch.wait(0)


def test_a_refused_ack_or_a_failed_request_fails_the_batch():
    book = BatchBook()
    refused, failed = Batch(1, 1), Batch(1, 1)
    seq, _ = book.open("p", refused, _requests(1), awaits_ack=True)
    book.acked(seq, "slice 0 checksum mismatch")
    with pytest.raises(TransferError, match="refused the batch: slice 0 checksum mismatch"):
        refused.wait(0)
    _, numbered = book.open("p", failed, _requests(2), awaits_ack=False)
    assert book.request_done(numbered[0].wr_id, TransferError("remote access"))[0] is failed
    with pytest.raises(TransferError, match="remote access"):
        failed.wait(0)
    assert book.request_done(numbered[1].wr_id) == (None, None) and book.in_flight() == 0


def test_losing_a_peer_fails_only_its_batches():
    book = BatchBook()
    lost, kept = Batch(1, 1), Batch(1, 1)
    book.open("lost", lost, _requests(1), awaits_ack=True)
    book.open("kept", kept, _requests(1), awaits_ack=False)
    assert book.fail_peer("lost", "peer gone") == 1
    with pytest.raises(TransferError, match="peer gone"):
        lost.wait(0)
    assert not kept.done() and book.in_flight() == 1


def test_sequence_numbers_fit_an_immediate():
    book = BatchBook()
    book._seq = iter([0x1_0000_0005])  # far past 32 bits: the immediate carries the low 32
    seq, numbered = book.open("p", Batch(1, 1), _requests(1), awaits_ack=True)
    assert seq == 5 and numbered[0].imm == 5


def test_completion_errors_say_what_happened():
    assert "did not answer" in describe_completion_error(12) and "IBV_WC_RETRY_EXC_ERR" in describe_completion_error(12)
    assert "wrong rkey" in describe_completion_error(9)
    assert "ibv_wc_status 99" in describe_completion_error(99, 0x42) and "0x42" in describe_completion_error(99, 0x42)


@pytest.mark.parametrize("notice_first", [True, False])
def test_inbound_book_pairs_notice_and_immediate_in_either_order(notice_first):
    book = ctl.InboundBook()
    notice = ctl.Notice(7, [("a", 0, "b", 0, 10)], b"hi", [1])
    if notice_first:
        assert book.notice(notice) is None
        assert book.landed(7) == notice
    else:
        assert book.landed(7) is None
        assert book.notice(notice) == notice
    assert book.pending() == 0


def test_control_frames_round_trip_and_garbage_is_refused():
    left, right = socket.socketpair()
    a, b = ctl.ControlChannel(left), ctl.ControlChannel(right)
    frames = [ctl.Connect("prefill-0", QpEndpoint(1, 2, 3, "0" * 32, 5), ["kv"]),
              ctl.Connected(QpEndpoint(4, 5, 6, "1" * 32, 5), [RemoteRegion("kv", 1, 2, 3)], []),
              ctl.Notice(9, [("a", 0, "b", 8, 16)], b"\x00msg", [2**64 - 1]), ctl.Ack(9, None),
              ctl.Ack(10, "bad"), ctl.RegionsWanted(["x"]), ctl.Regions([], ["x"]), ctl.Message(b"call")]
    for frame in frames:
        a.send(frame)
        assert b.receive() == frame
    left.sendall(struct.pack("!I", ctl.MAX_FRAME_BYTES + 1))
    with pytest.raises(TransferError, match="refused"):
        b.receive()
    left.sendall(struct.pack("!I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(TransferError, match="bad rdma control frame"):
        b.receive()
    a.close()
    with pytest.raises(TransferError, match="closed by the peer"):
        b.receive()
    b.close()
