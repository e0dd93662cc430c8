"""The nixl transport under two real TransferEngines (real NIXL and UCX), in this process and
with the peer engine in another process."""

from __future__ import annotations

import base64
import os
import signal
import time

import msgspec
import numpy as np
import pytest
import xxhash

from messenger.api import PeerInfo, Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.nixl_transport import nixl_missing
from tests.messenger import engine_checks
from tests.messenger.engine_peer import RANGE, REGION, PeerProcess

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))
MiB = 1 << 20


@pytest.fixture
def pair():
    p = engine_checks.EnginePair(EngineConfig(transports=("nixl",), timeout_s=5, call_lanes=False), "nixl")
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


def _engine_and_child(timeout_s: float):
    config = EngineConfig(transports=("nixl",), timeout_s=timeout_s)
    child = PeerProcess(config)
    engine = TransferEngine("parent", config)
    src = np.random.default_rng(3).integers(0, 256, 16 * MiB, dtype=np.uint8)
    engine.register("src", src)
    engine.start()
    assert engine.add_peer(child.info) == "nixl"
    return engine, child, src


def test_across_processes_write_read_call_then_a_killed_peer_fails_at_once():
    engine, child, src = _engine_and_child(timeout_s=5)
    try:
        engine.write("child", [Slice("src", 5 * MiB, REGION, MiB, 3 * MiB)], RANGE.pack(MiB, 3 * MiB)).wait(10)
        assert child.notification() == ("parent", RANGE.pack(MiB, 3 * MiB), None,
                                        xxhash.xxh3_64_intdigest(src[5 * MiB:8 * MiB]))
        engine.register("back", back := np.zeros(8 * MiB, dtype=np.uint8))
        engine.read("child", [Slice("back", 0, REGION, 0, 8 * MiB)]).wait(10)
        expected = child.expected.copy()
        expected[MiB:4 * MiB] = src[5 * MiB:8 * MiB]
        assert (back == expected).all()
        assert engine.call("child", b"hello") == b"child got hello"
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.join(5)
        started = time.monotonic()
        with pytest.raises(TransferError):
            engine.write("child", [Slice("src", 0, REGION, 0, MiB)], RANGE.pack(0, MiB)).wait(10)
        assert time.monotonic() - started < 3  # UCX saw the connection close: not the 5 s watchdog
    finally:
        engine.close()
        child.stop()


def test_a_silent_peer_fails_within_the_timeout():
    timeout_s = 2.0
    engine, child, _ = _engine_and_child(timeout_s)
    try:
        engine.write("child", [Slice("src", 0, REGION, 0, MiB)]).wait(10)
        os.kill(child.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        batches = [engine.write("child", [Slice("src", 0, REGION, 0, 4 * MiB)], RANGE.pack(0, MiB)) for _ in range(4)]
        for batch in batches:
            with pytest.raises(TransferError):
                batch.wait(3 * timeout_s)
        assert time.monotonic() - started < timeout_s + 4  # the timeout, and a margin for a loaded machine
        assert engine.stats()["nixl"]["failures"].get("timeout", 0) >= 4
    finally:
        os.kill(child.process.pid, signal.SIGCONT)
        engine.close()
        child.stop()


def test_unregister_deregisters_from_the_agent(pair):
    """The KV sender registers and unregisters a region per layer and step: NIXL registrations
    (and the agent's metadata) must not grow with them."""
    registered = pair.sender._transports["nixl"]._registered
    for i in range(10):
        pair.sender.register(f"rows-{i}", np.full(4096, i, dtype=np.uint8))
        pair.sender.write("receiver", [Slice(f"rows-{i}", 0, "dst", i * 4096, 4096)], b"n").wait(5)
        pair.sender.unregister(f"rows-{i}")
    assert not [name for name in registered if name.startswith("rows-")]
    assert (pair.dst[9 * 4096:10 * 4096] == 9).all()


def test_a_failed_batch_drops_the_peers_cached_regions(pair):
    """The receiver unregistered a region: once a batch into it fails, the sender asks again
    instead of writing on through the descriptor it cached (UCX over tcp/sm does not refuse it)."""
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    pair.receiver.unregister("dst")
    with pytest.raises(TransferError, match="no region 'dst'"):
        pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    pair.dst[:] = 0
    with pytest.raises(TransferError, match="has no registered region 'dst'"):
        pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    assert not pair.dst.any()


def test_a_frozen_peer_does_not_stall_batches_to_the_others(pair):
    """A peer that never answers for its regions holds up its own batches only."""
    from nixl_cu12 import nixl_agent, nixl_agent_config

    frozen = nixl_agent("frozen-agent", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))  # never polled
    address = msgspec.json.encode({"agent": "frozen-agent",
                                   "metadata": base64.b64encode(frozen.get_agent_metadata()).decode()}).decode()
    real = pair.receiver.info()
    pair.sender.add_peer(PeerInfo("frozen", real.host_id, {"nixl": address}, real.regions))
    stuck = pair.sender.write("frozen", [Slice("src", 0, "dst", 0, 4096)], b"n")
    time.sleep(0.2)  # it waits for the frozen peer's regions
    started = time.monotonic()
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 4096)], b"n").wait(5)
    assert time.monotonic() - started < 1.0  # not behind the frozen peer's 5 s wait
    with pytest.raises(TransferError):
        stuck.wait(10)
