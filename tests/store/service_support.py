"""What the PoolService tests share: a service with its arena and SSD tier (no messenger), and
blocks whose bytes follow from their key."""

from __future__ import annotations

import os

import numpy as np

from store.config import PoolConfig
from store.pool import checksum
from store.service import PoolService

BB = 8192
LAYOUT = "test-model/float32/block128"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def data(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BB, dtype=np.uint8)


def service(tmp_path=None, dram_blocks=4, ssd_blocks=16, ssd_dir=None) -> PoolService:
    ssd_dir = ssd_dir or (str(tmp_path / "ssd") if tmp_path is not None else None)
    config = PoolConfig(dram_bytes=dram_blocks * BB, ssd_dir=ssd_dir, ssd_bytes=ssd_blocks * BB)
    s = PoolService(config, remote=False).start()
    s.configure(BB, LAYOUT)
    return s


def put(s: PoolService, keys):
    for key, slot in s.reserve(keys):
        s.arena.slot(slot)[:] = data(key)
    return s.commit(keys)


def held_bytes(s: PoolService, keys) -> list[bool]:
    got = s.read(keys)
    try:
        return [np.array_equal(s.arena.slot(slot), data(key)) and checksum(s.arena.slot(slot)) == c
                for key, slot, c in got]
    finally:
        s.release([k for k, _, _ in got])
