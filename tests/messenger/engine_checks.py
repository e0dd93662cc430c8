"""Checks of a transport through two real TransferEngines (messenger/engine.py), shared by the
rdma (fake fabric) and nixl (real UCX) engine tests: the engine's promises, whatever the wire."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from messenger.api import ChecksumError, Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.integrity import PendingMessage

MiB = 1 << 20


class EnginePair:
    def __init__(self, config: EngineConfig, transport: str, size: int = 16 * MiB):
        self.sender, self.receiver = TransferEngine("sender", config), TransferEngine("receiver", config)
        self.src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
        self.dst = np.zeros(size, dtype=np.uint8)
        self.sender.register("src", self.src)
        self.receiver.register("dst", self.dst)
        self.notes: list = []
        self.sender.start(on_call=lambda peer, request: b"got " + request)
        info = self.receiver.start(on_notify=lambda peer, message, error: self.notes.append((peer, message, error)),
                                   on_call=lambda peer, request: b"got " + request)
        assert self.sender.add_peer(info) == transport
        assert self.receiver.add_peer(self.sender.info()) == transport

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


def write_read_call(pair: EnginePair) -> None:
    slices = [Slice("src", i * MiB + 3, "dst", (15 - i) * MiB, MiB - 7) for i in range(0, 12, 3)]
    pair.sender.write("receiver", slices, b"layer 3").wait(10)
    assert pair.notes == [("sender", b"layer 3", None)]
    for s in slices:
        assert (pair.dst[s.remote_offset:s.remote_offset + s.length] == pair.src[s.local_offset:s.local_offset + s.length]).all()
    pair.sender.write("receiver", [Slice("src", 0, "dst", 0, 1000)]).wait(10)  # no message: no notify
    pair.sender.write("receiver", [], b"only a note").wait(10)
    assert pair.notes[1:] == [("sender", b"only a note", None)]
    pair.sender.register("landing", landing := np.zeros(2 * MiB, dtype=np.uint8))
    pair.sender.read("receiver", [Slice("landing", 0, "dst", 15 * MiB, MiB)]).wait(10)
    assert (landing[:MiB] == pair.dst[15 * MiB:]).all() and landing[:MiB].any()
    assert pair.sender.call("receiver", b"hello") == b"got hello"
    assert pair.receiver.call("sender", b"back") == b"got back"


def concurrent_batches_do_not_mix(pair: EnginePair, threads: int = 32) -> None:
    size = len(pair.dst) // threads
    errors: list = []

    def push(i: int) -> None:
        try:
            part = size // 8
            slices = [Slice("src", i * size + k * part, "dst", i * size + (7 - k) * part, part) for k in range(8)]
            pair.sender.write("receiver", slices, i.to_bytes(2, "big")).wait(30)
        except Exception as exc:  # noqa: BLE001 -- surfaced below
            errors.append(exc)

    workers = [threading.Thread(target=push, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert errors == []
    part = size // 8
    for i in range(threads):
        for k in range(8):
            got = pair.dst[i * size + (7 - k) * part:i * size + (8 - k) * part]
            assert (got == pair.src[i * size + k * part:i * size + (k + 1) * part]).all(), (i, k)
    assert sorted(int.from_bytes(m, "big") for _, m, e in pair.notes if e is None) == list(range(threads))


def a_wrong_checksum_is_a_checksum_error(pair: EnginePair) -> None:
    """What a flipped byte looks like to the receiver: bytes that differ from the message's checksum."""
    from concurrent.futures import Future

    peer = pair.sender._peers["receiver"]
    real_submit = peer.transport.submit

    def tampering_submit(info, direction, slices, batch, message):
        good = message.checksums
        bad: Future = Future()
        bad.set_result((good[0] ^ 1, *good[1:]))
        real_submit(info, direction, slices, batch, PendingMessage(message.payload, bad))

    peer.transport.submit = tampering_submit
    try:
        batch = pair.sender.write("receiver", [Slice("src", 0, "dst", 0, MiB), Slice("src", MiB, "dst", MiB, 10)], b"n")
        with pytest.raises(ChecksumError, match="slice 0"):
            batch.wait(10)
    finally:
        peer.transport.submit = real_submit
    assert pair.notes[-1][1] == b"n" and "ChecksumError" in pair.notes[-1][2]


def bad_slices_fail(pair: EnginePair) -> None:
    with pytest.raises(TransferError):
        pair.sender.write("receiver", [Slice("src", 0, "nowhere", 0, 10)], b"x").wait(10)
    with pytest.raises(TransferError):
        pair.sender.read("receiver", [Slice("src", 0, "dst", len(pair.dst) - 5, 10)]).wait(10)
