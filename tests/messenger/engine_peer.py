"""A transfer engine in a child process, for the cross-process tests (multiprocessing spawn).

The child registers one region filled with bytes from `seed`, publishes its PeerInfo over the
pipe, and reports each notification as (message, error, xxh3 of the range the message names)
computed INSIDE on_notify: the test checks that the bytes were in place when it ran.
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import time

import msgspec
import numpy as np
import xxhash

from messenger.api import PeerInfo
from messenger.engine import EngineConfig, TransferEngine

REGION = "child"
# A notification message: offset and length (u64 each) of the range to hash, then free bytes.
RANGE = struct.Struct("!QQ")


def child_bytes(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _serve(pipe, config: EngineConfig, size: int, seed: int) -> None:
    region = child_bytes(seed, size)
    engine = TransferEngine("child", config)
    engine.register(REGION, region)

    def on_notify(peer: str, message: bytes, error: str | None) -> None:
        offset, length = RANGE.unpack_from(message)
        digest = xxhash.xxh3_64_intdigest(region[offset:offset + length])
        pipe.send(("notify", peer, message, error, digest))

    def on_call(peer: str, request: bytes) -> bytes:
        if request == b"fail":
            raise ValueError("asked to fail")
        return b"child got " + request

    info = engine.start(on_notify=on_notify, on_call=on_call)
    pipe.send(("info", msgspec.json.encode(info)))
    while True:
        try:
            command = pipe.recv()
        except EOFError:
            break
        if command == "stop":
            break
    engine.close()


class PeerProcess:
    """The child engine: start it, read its PeerInfo, collect its notifications, stop it."""

    def __init__(self, config: EngineConfig, size: int = 8 << 20, seed: int = 7):
        ctx = mp.get_context("spawn")
        self.pipe, child_end = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_end, config, size, seed), daemon=True)
        self.process.start()
        deadline = time.monotonic() + 60
        while not self.pipe.poll(0.1):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the child engine did not start (exit code {self.process.exitcode})")
        kind, info = self.pipe.recv()
        assert kind == "info"
        self.info = msgspec.json.decode(info, type=PeerInfo)
        self.expected = child_bytes(seed, size)

    def notification(self, timeout: float = 10.0):
        if not self.pipe.poll(timeout):
            raise TimeoutError("no notification from the child")
        return self.pipe.recv()[1:]

    def stop(self) -> None:
        try:
            self.pipe.send("stop")
        except OSError:
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
