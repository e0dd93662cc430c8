"""Mooncake Store's client for benchmarks/store_bench.py, run with the peer venv's python
(benchmarks/peers/venv.py: its `mooncake` module is Mooncake's, not ours).

    python mooncake_store_client.py holder MASTER METADATA BLOCK_BYTES COUNT
        mounts a segment, puts COUNT objects of BLOCK_BYTES, prints {"ready": ...}, serves
        until stdin closes (the objects live in its segment: others' gets are remote).
    python mooncake_store_client.py getter MASTER METADATA BLOCK_BYTES COUNT BATCH
        mounts no segment of its own and reads the holder's objects: get_into, then
        batch_get_into in batches of BATCH, into a registered buffer; also puts (remote put:
        they land in the holder's segment); prints one JSON line of figures.
    python mooncake_store_client.py local MASTER METADATA BLOCK_BYTES COUNT BATCH
        one client alone: puts and gets against its own segment.

Every figure is wall time around the calls only; the data is checked after the gets.
This file imports nothing of ours.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore

SEGMENT_SLACK = 64 << 20


def setup(master: str, metadata: str, segment_bytes: int, buffer_bytes: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", metadata, segment_bytes, buffer_bytes, "tcp", "", master)
    if code != 0:
        raise SystemExit(f"Mooncake Store setup failed: {code}")
    return store


def pattern(i: int, block_bytes: int) -> np.ndarray:
    return np.full(block_bytes, i % 251, dtype=np.uint8)


def rate(n: int, nbytes: int, seconds: float) -> dict:
    return {"ops_per_s": n / seconds, "gb_per_s": nbytes / seconds / 1e9, "ops": n, "seconds": seconds}


def put_all(store, prefix: str, block_bytes: int, count: int, buf: np.ndarray) -> dict:
    ptr = buf.ctypes.data
    started = time.perf_counter()
    for i in range(count):
        if store.put_from(f"{prefix}{i}", ptr + (i % 16) * block_bytes, block_bytes) != 0:
            raise SystemExit(f"put_from {prefix}{i} failed")
    return rate(count, count * block_bytes, time.perf_counter() - started)


def gets(store, prefix: str, block_bytes: int, count: int, batch: int, buf: np.ndarray) -> dict:
    ptr = buf.ctypes.data
    for i in range(count):  # warm-up, untimed, every key once (as ours): connections open, pages are touched
        store.get_into(f"{prefix}{i}", ptr + (i % 16) * block_bytes, block_bytes)
    started = time.perf_counter()
    for i in range(count):
        got = store.get_into(f"{prefix}{i}", ptr + (i % 16) * block_bytes, block_bytes)
        if got != block_bytes:
            raise SystemExit(f"get_into {prefix}{i}: {got}")
    single = rate(count, count * block_bytes, time.perf_counter() - started)
    if not np.all(buf[(count - 1) % 16 * block_bytes:][:block_bytes] == (count - 1) % 16):  # key i holds pattern(i % 16)
        raise SystemExit("get_into returned wrong bytes")
    started = time.perf_counter()
    for first in range(0, count - count % batch, batch):
        keys = [f"{prefix}{i}" for i in range(first, first + batch)]
        ptrs = [ptr + j * block_bytes for j in range(batch)]
        got = store.batch_get_into(keys, ptrs, [block_bytes] * batch)
        if any(g != block_bytes for g in got):
            raise SystemExit(f"batch_get_into: {got}")
    n = count - count % batch
    batched = rate(n, n * block_bytes, time.perf_counter() - started)
    return {"get": single, "batch_get": batched}


def main() -> None:
    role, master, metadata, block_bytes, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    buffer_bytes = max(16, batch) * block_bytes
    buf = np.zeros(buffer_bytes, dtype=np.uint8)
    for i in range(16):
        buf[i * block_bytes:(i + 1) * block_bytes] = pattern(i, block_bytes)
    if role == "holder":
        store = setup(master, metadata, count * block_bytes * 2 + SEGMENT_SLACK, buffer_bytes + SEGMENT_SLACK)
        store.register_buffer(buf.ctypes.data, buf.nbytes)
        put_all(store, "k", block_bytes, count, buf)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.read()
        store.close()
        return
    if role == "getter":
        store = setup(master, metadata, 0, buffer_bytes + SEGMENT_SLACK)
        store.register_buffer(buf.ctypes.data, buf.nbytes)
        figures = gets(store, "k", block_bytes, count, batch, buf)
        for i in range(16):
            buf[i * block_bytes:(i + 1) * block_bytes] = pattern(i, block_bytes)
        figures["put"] = put_all(store, "r", block_bytes, count, buf)
    else:
        store = setup(master, metadata, count * block_bytes * 2 + SEGMENT_SLACK, buffer_bytes + SEGMENT_SLACK)
        store.register_buffer(buf.ctypes.data, buf.nbytes)
        put = put_all(store, "k", block_bytes, count, buf)
        figures = {**gets(store, "k", block_bytes, count, batch, buf), "put": put}
    print(json.dumps(figures), flush=True)
    store.close()
    ctypes.pythonapi  # noqa: B018 - keep ctypes imported for buffer pointers' lifetime semantics


if __name__ == "__main__":
    main()
