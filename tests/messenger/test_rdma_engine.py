"""The rdma transport under two real TransferEngines. No device exists here: the engines' rdma
transports run on the in-process fabric of tests/messenger/fake_verbs.py (the only stand-in:
control connections, threads, registration, flow control and the engine are all real)."""

from __future__ import annotations

import pytest

import messenger.rdma as rdma_module
from messenger.engine import EngineConfig, TransferEngine
from messenger.rdma_plan import RdmaConfig
from tests.messenger import engine_checks
from tests.messenger.fake_verbs import Fabric, FakePort


@pytest.fixture
def pair(monkeypatch):
    fabric = Fabric()
    small = RdmaConfig(max_message_bytes=256 * 1024, send_depth=16, recv_depth=4, poll_idle_s=0.0005)
    real = rdma_module.RdmaTransport
    monkeypatch.setattr(rdma_module, "RdmaTransport",
                        lambda config: real(config, small, open_port=lambda c: FakePort(fabric, c)))
    p = engine_checks.EnginePair(EngineConfig(transports=("rdma",), timeout_s=5, call_lanes=False), "rdma")
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
