"""The nixl transport under two real TransferEngines (real NIXL and UCX), in this process and
with the peer engine in another process."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import numpy as np
import pytest
import xxhash

from messenger.api import Slice, TransferError
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
