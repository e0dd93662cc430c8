"""The least of an engine a transport needs in a test: a region table and an inbound handler.

Until messenger/engine.py (TransferEngine) is merged, transports are tested against these
implementations of api.py's RegionTable and InboundHandler protocols. They do what the engine
promises to do: bounds-checked regions over numpy arrays, xxh3-64 verification of every slice
that lands, the notification handed on with the error (or None).
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import xxhash

from messenger.api import OutgoingMessage, Region, Slice


class Regions:
    """api.RegionTable over numpy arrays."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self.arrays: dict[str, np.ndarray] = {}

    def add(self, name: str, nbytes: int, fill: int | None = None) -> np.ndarray:
        array = np.zeros(nbytes, dtype=np.uint8) if fill is None else np.full(nbytes, fill, dtype=np.uint8)
        self.arrays[name] = array
        self._regions[name] = Region(name, nbytes, array.ctypes.data, memoryview(array).cast("B"))
        return array

    def get(self, name: str) -> Region:
        return self._regions[name]


def checksums(regions: Regions, slices: list[Slice]) -> tuple[int, ...]:
    """What the sending engine computes: xxh3-64 of each slice's local bytes."""
    return tuple(xxhash.xxh3_64_intdigest(regions.arrays[s.local_region][s.local_offset:s.local_offset + s.length])
                 for s in slices)


class Inbound:
    """api.InboundHandler: verifies slices against the message's checksums, records what came."""

    def __init__(self, regions: Regions) -> None:
        self.regions = regions
        self.notified: queue.Queue[tuple[str, bytes, str | None]] = queue.Queue()
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.landed_batches = 0
        self._lock = threading.Lock()

    def slices_landed(self, peer: str, slices: list[Slice], message: OutgoingMessage | None) -> str | None:
        error = None
        if message is not None and message.checksums:
            if len(message.checksums) != len(slices):
                error = f"{len(message.checksums)} checksums for {len(slices)} slices"
            for i, s in enumerate(slices):
                got = xxhash.xxh3_64_intdigest(
                    self.regions.arrays[s.remote_region][s.remote_offset:s.remote_offset + s.length])
                if error is None and got != message.checksums[i]:
                    error = f"slice {i} checksum mismatch"
        with self._lock:
            self.landed_batches += 1
        self.notified.put((peer, message.payload if message else b"", error))
        return error

    def message(self, peer: str, payload: bytes) -> None:
        self.messages.put((peer, payload))
