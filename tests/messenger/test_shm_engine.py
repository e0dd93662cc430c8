"""The shm transport under the real TransferEngine (messenger/engine.py), between two processes:
the engine picks it for a peer on this host, checksums ride along, notifications and calls work,
and a dead peer fails batches before the engine's timeout."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from messenger.api import Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from tests.messenger.shm_harness import EngineProcess, digest

SIZE = 4 << 20


@pytest.fixture(scope="module")
def peer():
    process = EngineProcess(size=SIZE, transports=("shm", "tcp"))
    yield process
    process.stop()


@pytest.fixture
def engine(peer):
    mem = np.zeros(SIZE, np.uint8)
    local = TransferEngine("local", EngineConfig(transports=("shm", "tcp")))
    local.register("mem", mem)
    info = local.start(on_call=lambda peer_name, request: b"local:" + request)
    assert local.add_peer(peer.info) == "shm"  # same host: shm, though tcp runs too
    assert peer("add_peer", msgspec.json.encode(info)) == "shm"
    yield local, mem
    local.close()


def test_a_checksummed_write_lands_before_on_notify(peer, engine):
    local, mem = engine
    mem[:] = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    peer("fill", 2)
    slices = [Slice("mem", i * 65536, "mem", (63 - i) * 65536, 65536) for i in range(64)]
    local.write("peer", slices, b"all of it").wait(10)
    peer_name, message, error, seen = peer("notes")[-1]
    assert (peer_name, message, error) == ("local", b"all of it", None)
    expected = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    for s in slices:
        expected[s.remote_offset:s.remote_offset + s.length] = mem[s.local_offset:s.local_offset + s.length]
    assert seen == digest(expected)
    assert peer("digest", (0, SIZE)) == digest(expected)
    stats = local.stats()["shm"]
    assert stats["sent_bytes"] >= SIZE and stats["request_seconds"]["count"] >= 1


def test_a_read_and_a_call_through_the_engine(peer, engine):
    local, mem = engine
    peer("fill", 5)
    expected = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    local.read("peer", [Slice("mem", 0, "mem", 0, SIZE)]).wait(10)
    assert np.array_equal(mem, expected)
    assert local.call("peer", b"ping") == b"echo:ping"


def test_a_dead_peer_fails_a_batch_long_before_the_engine_timeout():
    process = EngineProcess(size=SIZE)
    local = TransferEngine("local", EngineConfig(transports=("shm",), timeout_s=30))
    local.register("mem", np.zeros(SIZE, np.uint8))
    local.start()
    try:
        local.add_peer(process.info)
        local.write("peer", [Slice("mem", 0, "mem", 0, 4096)], b"first").wait(10)
        process.kill()
        started = time.monotonic()
        with pytest.raises(TransferError, match="shm peer"):
            local.write("peer", [Slice("mem", 0, "mem", 0, 4096)], b"second").wait(30)
        assert time.monotonic() - started < 5
    finally:
        local.close()
        process.stop()
