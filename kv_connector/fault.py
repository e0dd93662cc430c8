"""TEST ONLY, off by default: make the wire flip a byte, to show the KV path catches it.

`flip_bytes_on_the_wire(engine, count)` wraps the submit of every transport the engine runs so
that the next `count` written batches send their first slice from a copy with one byte flipped.
The engine has already taken that slice's checksum from the real bytes, so the receiving engine's
check fails, as it would for a bit flipped on a bad link: the decode worker's load fails and vLLM
recomputes; the prefill's push outcome says checksum. Enabled only by the connector setting
`kv_fault_flip` (kv_connector_extra_config) or the env MOONCAKE_KV_FAULT_FLIP, which tests set.
It reaches into the engine's transports (a private table) on purpose: a fault must sit below the
engine's checksums, where nothing public reaches.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from messenger.api import Direction, Slice


def flip_bytes_on_the_wire(engine, count: int) -> None:
    if count <= 0:
        return
    left = [count]
    lock = threading.Lock()
    names = (f"kv-fault-{i}" for i in itertools.count())
    for transport in engine._transports.values():  # noqa: SLF001 - see the module docstring
        submit = transport.submit

        def flipping(peer, direction, slices, batch, message, submit=submit):
            with lock:
                flip = direction is Direction.WRITE and slices and left[0] > 0
                left[0] -= bool(flip)
            if flip:
                first = slices[0]
                source = engine._regions.get(first.local_region).view  # noqa: SLF001
                bad = np.frombuffer(source[first.local_offset:first.local_offset + first.length], np.uint8).copy()
                bad[len(bad) // 2] ^= 0x01
                name = next(names)
                engine.register(name, bad)  # kept registered: the transport reads it after we return
                slices = [Slice(name, 0, first.remote_region, first.remote_offset, first.length), *slices[1:]]
            return submit(peer, direction, slices, batch, message)

        transport.submit = flipping
