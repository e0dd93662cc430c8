"""messenger/nixl_transport.py between two processes, over NIXL's UCX backend (real NIXL, real
UCX: tcp and shared memory on this machine). The peer process is tests/messenger/nixl_peer.py."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xxhash

from messenger.api import Batch, Direction, OutgoingMessage, PeerInfo, Slice, TransferError
from messenger.nixl_transport import NixlConfig, NixlTransport, nixl_missing
from tests.messenger.minimal_engine import Inbound, Regions, checksums

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

MiB = 1 << 20
PEER_BYTES = 32 * MiB
ROOT = Path(__file__).resolve().parents[2]


class Settings:
    timeout_s = 10.0


class PeerProcess:
    def __init__(self, name: str):
        env = dict(os.environ, UCX_MODULES="^ib", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.messenger.nixl_peer", name, str(PEER_BYTES)],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = msgspec.json.decode(json.dumps(self.next("info")).encode(), type=PeerInfo)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def next(self, key: str, timeout: float = 30.0):
        while True:
            line = self.lines.get(timeout=timeout)
            if key in line:
                return line[key]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(exit=True)
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def peer():
    process = PeerProcess("decode")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def local(peer):
    regions = Regions()
    inbound = Inbound(regions)
    transport = NixlTransport(Settings(), NixlConfig(ucx_tls="tcp,sm,self"))
    info = PeerInfo("prefill", "test-host", {"nixl": transport.start(regions, inbound)})
    assert transport.can_reach(info, peer.info)
    peer.send(peer=msgspec.json.decode(msgspec.json.encode(info)))
    src = regions.add("src", PEER_BYTES)
    src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
    regions.add("dst", PEER_BYTES)
    yield transport, regions, inbound, info
    transport.close()


def _digest(array) -> int:
    return xxhash.xxh3_64_intdigest(array)


def test_write_lands_in_the_peer_and_its_message_after_it(peer, local):
    transport, regions, _, _ = local
    src = regions.arrays["src"]
    slices = [Slice("src", 0, "kv", 0, 16 * MiB), Slice("src", 16 * MiB, "kv", 16 * MiB + 4096, 1 * MiB)]
    batch = Batch(17 * MiB, 2)
    transport.submit(peer.info, Direction.WRITE, slices, batch, OutgoingMessage(b"layer 0", checksums(regions, slices)))
    batch.wait(20)
    assert peer.next("notify") == ["prefill", "layer 0", None]
    expected = np.zeros(PEER_BYTES, dtype=np.uint8)
    expected[:16 * MiB] = src[:16 * MiB]
    expected[16 * MiB + 4096:17 * MiB + 4096] = src[16 * MiB:17 * MiB]
    peer.send(digest="kv")
    assert peer.next("digest") == _digest(expected)
    assert transport.stats()["sent_bytes"] >= 17 * MiB


def test_a_corrupt_batch_fails_on_both_sides(peer, local):
    transport, regions, _, _ = local
    slices = [Slice("src", 0, "kv", 0, MiB)]
    good = checksums(regions, slices)
    batch = Batch(MiB, 1)
    transport.submit(peer.info, Direction.WRITE, slices, batch, OutgoingMessage(b"bad", (good[0] ^ 1,)))
    with pytest.raises(TransferError, match="refused the batch: slice 0 checksum mismatch"):
        batch.wait(20)
    assert peer.next("notify") == ["prefill", "bad", "slice 0 checksum mismatch"]


def test_read_pulls_the_peer_region(peer, local):
    transport, regions, _, _ = local
    batch = Batch(3 * MiB, 2)
    transport.submit(peer.info, Direction.READ, [Slice("dst", 0, "pool", 5, 2 * MiB),
                                                 Slice("dst", 4 * MiB, "pool", 8 * MiB, MiB)], batch, None)
    batch.wait(20)
    pattern = np.tile(np.arange(256, dtype=np.uint8), PEER_BYTES // 256)
    dst = regions.arrays["dst"]
    assert bytes(dst[:2 * MiB]) == bytes(pattern[5:5 + 2 * MiB])
    assert bytes(dst[4 * MiB:5 * MiB]) == bytes(pattern[8 * MiB:9 * MiB])


def test_many_batches_in_flight(peer, local):
    transport, regions, _, _ = local
    batches = []
    for i in range(32):
        slices = [Slice("src", i * 65536, "kv", i * 65536, 65536)]
        batch = Batch(65536, 1)
        transport.submit(peer.info, Direction.WRITE, slices, batch, OutgoingMessage(b"%d" % i, checksums(regions, slices)))
        batches.append(batch)
    for batch in batches:
        batch.wait(20)
    got = sorted(peer.next("notify")[1] for _ in range(32))
    assert got == sorted(str(i) for i in range(32))


def test_messages_and_writes_both_ways(peer, local):
    transport, regions, inbound, info = local
    batch = Batch(0, 0)
    transport.send_message(peer.info, b"ping", batch)
    batch.wait(10)
    assert peer.next("message") == ["prefill", "ping"]
    assert inbound.messages.get(timeout=10) == ("decode", b"pong")
    peer.send(write=[["pool", 0, "dst", 10 * MiB, MiB]], to="prefill")
    assert peer.next("written") is None
    assert inbound.notified.get(timeout=10) == ("decode", b"from the peer", None)
    pattern = np.tile(np.arange(256, dtype=np.uint8), MiB // 256)
    assert bytes(regions.arrays["dst"][10 * MiB:11 * MiB]) == bytes(pattern)


def test_bad_slices_fail_clearly(peer, local):
    transport, regions, _, _ = local
    for bad, why in [(Slice("src", 0, "nope", 0, 10), "has no registered region 'nope'"),
                     (Slice("src", 0, "kv", PEER_BYTES - 5, 10), "outside the peer's region 'kv'"),
                     (Slice("missing", 0, "kv", 0, 10), "no registered region 'missing' here"),
                     (Slice("src", PEER_BYTES - 5, "kv", 0, 10), "outside region 'src'")]:
        batch = Batch(10, 1)
        transport.submit(peer.info, Direction.WRITE, [bad], batch, None)
        with pytest.raises(TransferError, match=why):
            batch.wait(10)


def test_a_killed_peer_fails_the_batch_instead_of_hanging():
    victim = PeerProcess("victim")
    regions = Regions()
    regions.add("src", MiB)
    transport = NixlTransport(Settings())
    info = PeerInfo("killer", "test-host", {"nixl": transport.start(regions, Inbound(regions))})
    try:
        transport.can_reach(info, victim.info)
        first = Batch(MiB, 1)
        transport.submit(victim.info, Direction.WRITE, [Slice("src", 0, "kv", 0, MiB)], first, None)
        first.wait(20)
        victim.proc.kill()
        victim.proc.wait()
        second = Batch(MiB, 1)
        transport.submit(victim.info, Direction.WRITE, [Slice("src", 0, "kv", 0, MiB)],
                         second, OutgoingMessage(b"x", checksums(regions, [Slice("src", 0, "kv", 0, MiB)])))
        with pytest.raises(TransferError, match="nixl transfer (to|with) 'victim' failed"):
            second.wait(5)  # UCX notices the closed connection: no need for the engine's timeout
    finally:
        transport.close()
