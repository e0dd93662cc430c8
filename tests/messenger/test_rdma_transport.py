"""messenger/rdma.py end to end on an in-process fabric (tests/messenger/fake_verbs.py): real
control connections over TCP, real threads, bytes moved by address; only the NIC is simulated.
Plus what the transport says on this machine with the real pyverbs (no device)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Slice, TransferError
from messenger.rdma import RdmaTransport
from messenger.rdma_plan import RdmaConfig
from tests.messenger.fake_verbs import Fabric, FakePort
from tests.messenger.minimal_engine import Inbound, Regions, checksums

MiB = 1 << 20


@dataclass(frozen=True)
class EngineSettings:
    """The fields of the engine's EngineConfig the rdma transport reads."""

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    timeout_s: float = 5.0
    auth_key: bytes | None = None


class Side:
    def __init__(self, name: str, fabric: Fabric, rdma: RdmaConfig, settings: EngineSettings):
        self.regions = Regions()
        self.inbound = Inbound(self.regions)
        self.ports: list[FakePort] = []

        def open_port(config):
            self.ports.append(FakePort(fabric, config))
            return self.ports[-1]

        self.transport = RdmaTransport(settings, rdma, open_port=open_port)
        self.name = name

    def start(self) -> PeerInfo:
        address = self.transport.start(self.regions, self.inbound)
        self.info = PeerInfo(self.name, "host-" + self.name, {"rdma": address})
        return self.info


@pytest.fixture
def pair(request):
    params = getattr(request, "param", {})
    fabric = Fabric()
    rdma = params.get("rdma", RdmaConfig(max_message_bytes=64 * 1024, send_depth=8, recv_depth=4, poll_idle_s=0.0005))
    a = Side("prefill", fabric, rdma, params.get("a", EngineSettings()))
    b = Side("decode", fabric, rdma, params.get("b", EngineSettings()))
    a.start(), b.start()
    assert a.transport.can_reach(a.info, b.info) and b.transport.can_reach(b.info, a.info)
    yield a, b, fabric
    a.transport.close()
    b.transport.close()


def _write(a: Side, b: Side, slices, payload: bytes | None = b"layer 3", corrupt=False) -> Batch:
    batch = Batch(sum(s.length for s in slices), len(slices))
    message = None
    if payload is not None:
        sums = checksums(a.regions, slices)
        message = OutgoingMessage(payload, tuple(x ^ 1 for x in sums) if corrupt else sums)
    a.transport.submit(b.info, Direction.WRITE, slices, batch, message)
    return batch


def test_write_lands_split_and_flow_controlled_then_the_peer_is_told(pair):
    a, b, fabric = pair
    src = a.regions.add("kv", 4 * MiB)
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    dst = b.regions.add("kv", 4 * MiB)
    slices = [Slice("kv", 0, "kv", MiB, MiB), Slice("kv", 2 * MiB, "kv", 0, 3 * 65536 + 17)]
    batch = _write(a, b, slices)
    batch.wait(5)
    assert bytes(dst[MiB:2 * MiB]) == bytes(src[:MiB])
    assert bytes(dst[:3 * 65536 + 17]) == bytes(src[2 * MiB:2 * MiB + 3 * 65536 + 17])
    assert dst[3 * 65536 + 17:MiB].sum() == 0
    assert b.inbound.notified.get(timeout=5) == ("prefill", b"layer 3", None)
    # 16 + 4 requests of at most 64 KiB each went through a send queue 8 deep (the fake refuses more)
    assert fabric.posted == 20
    assert a.transport.stats()["sent_bytes"] == MiB + 3 * 65536 + 17
    assert a.transport.stats()["in_flight_batches"] == 0


def test_a_write_without_a_message_completes_without_telling_the_peer(pair):
    a, b, _ = pair
    a.regions.add("src", 8192, fill=7)
    dst = b.regions.add("dst", 8192)
    _write(a, b, [Slice("src", 0, "dst", 4096, 4096)], payload=None).wait(5)
    assert (dst[4096:] == 7).all() and (dst[:4096] == 0).all()
    assert b.inbound.notified.empty()


def test_many_batches_in_flight_each_complete_once(pair):
    a, b, _ = pair
    a.regions.add("src", 64 * 4096, fill=3)
    b.regions.add("dst", 64 * 4096)
    batches = [_write(a, b, [Slice("src", i * 4096, "dst", i * 4096, 4096)], payload=b"%d" % i) for i in range(64)]
    for batch in batches:
        batch.wait(5)
    got = sorted(b.inbound.notified.get(timeout=5)[1] for _ in range(64))
    assert got == sorted(b"%d" % i for i in range(64))  # more batches than receives posted (4): reposted


def test_read_pulls_the_peer_bytes(pair):
    a, b, _ = pair
    local = a.regions.add("cache", 300_000)
    remote = b.regions.add("pool", 300_000)
    remote[:] = np.arange(remote.size, dtype=np.uint64).astype(np.uint8)
    batch = Batch(200_000, 1)
    a.transport.submit(b.info, Direction.READ, [Slice("cache", 100_000, "pool", 50_000, 200_000)], batch, None)
    batch.wait(5)
    assert bytes(local[100_000:]) == bytes(remote[50_000:250_000])
    assert b.inbound.notified.empty()  # one-sided: the peer's CPU took no part


def test_a_corrupt_slice_fails_the_batch_on_both_sides(pair):
    a, b, _ = pair
    a.regions.add("kv", 4096, fill=1)
    b.regions.add("kv", 4096)
    batch = _write(a, b, [Slice("kv", 0, "kv", 0, 4096)], corrupt=True)
    with pytest.raises(TransferError, match="refused the batch: slice 0 checksum mismatch"):
        batch.wait(5)
    assert b.inbound.notified.get(timeout=5) == ("prefill", b"layer 3", "slice 0 checksum mismatch")


def test_bad_slices_fail_before_anything_moves(pair):
    a, b, fabric = pair
    a.regions.add("kv", 4096)
    b.regions.add("kv", 4096)
    for bad, why in [(Slice("kv", 0, "nope", 0, 10), "no registered region 'nope'"),
                     (Slice("kv", 0, "kv", 4000, 100), "outside the peer's region 'kv'"),
                     (Slice("missing", 0, "kv", 0, 10), "no registered region .missing. here")]:
        payload = None if bad.local_region == "missing" else b"x"  # the engine would refuse it before checksums
        with pytest.raises(TransferError, match=why):
            _write(a, b, [bad], payload=payload).wait(5)
    assert fabric.posted == 0


def test_a_peer_that_stops_answering_fails_the_batch_and_the_link_reconnects(pair):
    a, b, fabric = pair
    a.regions.add("kv", 4096, fill=9)
    dst = b.regions.add("kv", 4096)
    fabric.dead.add(b.ports[0])
    with pytest.raises(TransferError, match="did not answer"):
        _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)
    fabric.dead.clear()
    _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)  # a new queue pair, a new control connection
    assert (dst == 9).all()


def test_a_closed_peer_fails_batches_waiting_for_its_ack(pair):
    a, b, _ = pair
    a.regions.add("kv", 4096)
    b.regions.add("kv", 4096)
    _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)  # connected
    b.inbound.slices_landed = lambda *args: time.sleep(1)  # b never answers this one in time...
    batch = _write(a, b, [Slice("kv", 0, "kv", 0, 4096)])
    time.sleep(0.2)
    b.transport.close()  # ...and goes away
    with pytest.raises(TransferError, match="lost"):
        batch.wait(5)


def test_messages_without_slices_both_ways(pair):
    a, b, _ = pair
    for sender, receiver in ((a, b), (b, a)):
        batch = Batch(0, 0)
        sender.transport.send_message(receiver.info, b"where do I write?", batch)
        batch.wait(5)
        assert receiver.inbound.messages.get(timeout=5) == (sender.name, b"where do I write?")


@pytest.mark.parametrize("pair", [{"a": EngineSettings(auth_key=b"k" * 32), "b": EngineSettings(auth_key=b"k" * 32)}],
                         indirect=True)
def test_control_connections_are_authenticated(pair):
    a, b, _ = pair
    a.regions.add("kv", 4096, fill=4)
    b.regions.add("kv", 4096)
    _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)


@pytest.mark.parametrize("pair", [{"a": EngineSettings(auth_key=b"k" * 32), "b": EngineSettings(auth_key=b"j" * 32)}],
                         indirect=True)
def test_a_peer_with_another_key_is_refused(pair):
    a, b, fabric = pair
    a.regions.add("kv", 4096)
    b.regions.add("kv", 4096)
    with pytest.raises(TransferError, match="cannot connect an rdma queue pair"):
        _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)
    assert fabric.posted == 0


def test_regions_are_registered_once_and_again_when_moved(pair):
    a, b, _ = pair
    a.regions.add("kv", 4096)
    b.regions.add("kv", 4096)
    for _ in range(3):
        _write(a, b, [Slice("kv", 0, "kv", 0, 4096)]).wait(5)
    assert len(a.ports[0].registered) == 1 and len(b.ports[0].registered) == 1
    a.regions.add("kv", 8192, fill=5)  # the same name, new memory
    _write(a, b, [Slice("kv", 4096, "kv", 0, 4096)]).wait(5)
    assert len(a.ports[0].registered) == 2 and (b.regions.arrays["kv"] == 5).all()


def test_no_peer_rdma_address_means_unreachable(pair):
    a, b, _ = pair
    assert not a.transport.can_reach(a.info, PeerInfo("x", "h", {"tcp": "1.2.3.4:5"}))
    assert not a.transport.can_reach(a.info, PeerInfo("x", "h", {"rdma": "{garbage"}))
    assert not a.transport.can_reach(PeerInfo("me", "h", {"tcp": "x"}), b.info)


def test_on_this_machine_rdma_is_unavailable_with_a_reason_and_start_fails_clearly():
    transport = RdmaTransport(EngineSettings())
    reason = transport.available()
    assert reason is not None
    assert reason.startswith(("no RDMA device", "pyverbs not importable")), reason
    with pytest.raises(TransferError, match="no RDMA device|pyverbs not importable"):
        transport.start(Regions(), Inbound(Regions()))
    transport.close()


def test_threads_submitting_to_a_new_peer_share_one_link(pair):
    import threading

    a, b, fabric = pair
    a.regions.add("kv", 8 * 4096, fill=2)
    b.regions.add("kv", 8 * 4096)
    batches: list[Batch] = []
    threads = [threading.Thread(target=lambda i=i: batches.append(_write(a, b, [Slice("kv", i * 4096, "kv", i * 4096,
                                                                                     4096)])))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for batch in batches:
        batch.wait(5)
    assert len(fabric.qps) == 2  # one queue pair each side: nobody connected twice
    assert (b.regions.arrays["kv"] == 2).all()


def test_batches_without_slices_complete(pair):
    a, b, _ = pair
    read, note = Batch(0, 0), Batch(0, 0)
    a.transport.submit(b.info, Direction.READ, [], read, None)
    a.transport.submit(b.info, Direction.WRITE, [], note, OutgoingMessage(b"just this", ()))
    read.wait(5)
    note.wait(5)
    assert b.inbound.notified.get(timeout=5) == ("prefill", b"just this", None)


def test_a_wildcard_bound_engine_publishes_its_advertised_host_for_the_control_channel():
    """--host 0.0.0.0 --advertise-host: the QP exchange is reached there, as the tcp transport is
    (it published 0.0.0.0, which no peer can reach)."""
    from messenger.rdma_plan import PortAddress

    side = Side("wild", Fabric(), RdmaConfig(), EngineSettings(host="0.0.0.0", advertise_host="10.9.8.7"))
    try:
        assert PortAddress.decode(side.start().transports["rdma"]).control.startswith("10.9.8.7:")
    finally:
        side.transport.close()
