"""The rdma transport under two real TransferEngines. No device exists here: the engines' rdma
transports run on the in-process fabric of tests/messenger/fake_verbs.py (the only stand-in:
control connections, threads, registration, flow control and the engine are all real)."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import messenger.rdma as rdma_module
from messenger.api import PeerInfo, Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.rdma_plan import PortAddress, RdmaConfig
from tests.messenger import engine_checks
from tests.messenger.fake_verbs import Fabric, FakePort


@pytest.fixture
def pair(monkeypatch, request):
    fabric = Fabric()
    small = RdmaConfig(max_message_bytes=256 * 1024, send_depth=16, recv_depth=4, poll_idle_s=0.0005)
    real = rdma_module.RdmaTransport
    monkeypatch.setattr(rdma_module, "RdmaTransport",
                        lambda config: real(config, small, open_port=lambda c: FakePort(fabric, c)))
    timeout_s = getattr(request, "param", 5)
    p = engine_checks.EnginePair(EngineConfig(transports=("rdma",), timeout_s=timeout_s, call_lanes=False), "rdma")
    yield p
    p.close()


def test_write_read_notify_and_calls(pair):
    engine_checks.write_read_call(pair)


def test_32_concurrent_batches_do_not_mix(pair):
    engine_checks.concurrent_batches_do_not_mix(pair)


def test_a_wrong_checksum_is_a_checksum_error(pair):
    engine_checks.a_wrong_checksum_is_a_checksum_error(pair)


def test_bad_slices_fail(pair):
    engine_checks.bad_slices_fail(pair)


def test_the_engine_skips_rdma_here_and_says_why():
    engine = TransferEngine("alone", EngineConfig(transports=("rdma", "tcp")))
    try:
        info = engine.start()
        assert "rdma" not in info.transports and "tcp" in info.transports
    finally:
        engine.close()


def test_unregister_deregisters_the_mr(pair):
    """The KV sender registers and unregisters a region per layer and step: MRs must not pile up."""
    mrs = pair.sender._transports["rdma"]._mrs
    for i in range(20):
        pair.sender.register(f"rows-{i}", np.full(4096, i, dtype=np.uint8))
        pair.sender.write("receiver", [Slice(f"rows-{i}", 0, "dst", i * 4096, 4096)], b"n").wait(5)
        pair.sender.unregister(f"rows-{i}")
    assert not [name for name in mrs if name.startswith("rows-")]
    assert (pair.dst[19 * 4096:20 * 4096] == 19).all()


def test_a_peer_cannot_write_into_a_region_its_owner_unregistered(pair):
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)  # the sender caches the rkey
    pair.receiver.unregister("dst")
    pair.dst[:] = 0
    with pytest.raises(TransferError, match="refused access"):
        pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    assert not pair.dst.any()
    # Registered again elsewhere under the same name: the next batch asks for it afresh.
    pair.receiver.register("dst", again := np.zeros(4096, dtype=np.uint8))
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    assert (again == pair.src[:4096]).all() and not pair.dst.any()


def _frozen_peer(pair) -> tuple[socket.socket, PeerInfo]:
    """A peer whose control channel accepts (the kernel does it) and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    real = pair.receiver.info()
    pa = PortAddress.decode(real.transports["rdma"])
    address = PortAddress(pa.device, pa.port, pa.lid, pa.gid, pa.mtu, f"127.0.0.1:{listener.getsockname()[1]}")
    return listener, PeerInfo("frozen", real.host_id, {"rdma": address.encode()}, real.regions)


@pytest.mark.parametrize("pair", [3], indirect=True)
def test_a_frozen_peer_does_not_stall_batches_to_the_others(pair):
    listener, frozen = _frozen_peer(pair)
    try:
        pair.sender.add_peer(frozen)
        stuck = pair.sender.write("frozen", [Slice("src", 0, "dst", 0, 4096)], b"n")
        time.sleep(0.2)  # its connect is under way
        started = time.monotonic()
        pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
        assert time.monotonic() - started < 1.0  # not behind the frozen peer's 3 s connect
        with pytest.raises(TransferError):
            stuck.wait(10)
    finally:
        listener.close()


@pytest.mark.parametrize("pair", [3], indirect=True)
def test_close_fails_batches_still_queued_or_connecting(pair):
    listener, frozen = _frozen_peer(pair)
    try:
        pair.sender.add_peer(frozen)
        connecting = pair.sender.write("frozen", [Slice("src", 0, "dst", 0, 4096)], b"n")
        queued = pair.sender.write("frozen", [Slice("src", 0, "dst", 0, 4096)], b"n")
        time.sleep(0.2)
        pair.sender.close()
        for batch in (connecting, queued):
            with pytest.raises(TransferError, match="closed"):
                batch.wait(0.5)  # at once, not after the timeout (nor never)
    finally:
        listener.close()


def test_the_engines_rdma_settings_reach_the_port_it_opens(monkeypatch):
    """RdmaConfig could not be given through TransferEngine: every engine opened the first device
    at GID 0, which a RoCE v2 fabric usually cannot route. The operator's settings come from
    MOONCAKE_RDMA_* and reach the port."""
    opened = []
    real = rdma_module.RdmaTransport

    def transport(config):
        def open_port(rdma):
            opened.append(rdma)
            raise OSError("no device here")
        return real(config, open_port=open_port)

    monkeypatch.setattr(rdma_module, "RdmaTransport", transport)
    env = {"MOONCAKE_RDMA_DEVICE": "mlx5_1", "MOONCAKE_RDMA_PORT": "2", "MOONCAKE_RDMA_GID_INDEX": "3"}
    config = EngineConfig(transports=("rdma", "tcp"), call_lanes=False, rdma=RdmaConfig.from_env(env))
    engine = TransferEngine("e", config)
    try:
        engine.start()
    finally:
        engine.close()
    assert [(c.device, c.port, c.gid_index) for c in opened] == [("mlx5_1", 2, 3)]
    assert RdmaConfig.from_env({}) == RdmaConfig()
    with pytest.raises(ValueError, match="MOONCAKE_RDMA_GID_INDEX='three'"):
        RdmaConfig.from_env({"MOONCAKE_RDMA_GID_INDEX": "three"})
