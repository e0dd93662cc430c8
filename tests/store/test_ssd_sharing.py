"""Several pools' SSD tiers on one disk (serve's workers, each in its own subdirectory): each
starts at its share of the free space, and together they never claim it more than once."""

from __future__ import annotations

import os
import subprocess

import pytest

from store.config import PoolConfig
from store.service import PoolService
from tests.store.service_support import BB, LAYOUT, put


def pool(ssd_dir, shared_by: int, block_bytes: int = BB, ssd_bytes: int = 1 << 30) -> PoolService:
    s = PoolService(PoolConfig(dram_bytes=2 * block_bytes, ssd_dir=str(ssd_dir), ssd_bytes=ssd_bytes,
                               ssd_shared_by=shared_by), remote=False).start()
    s.configure(block_bytes, LAYOUT)
    return s


def ssd_blocks(s: PoolService) -> int:
    return s.stats()["usage"]["ssd"]["capacity_bytes"] // s.config.block_bytes


def test_each_pool_on_a_shared_disk_starts_at_its_share_besides_its_own_files(tmp_path, monkeypatch, caplog):
    real_statvfs = os.statvfs

    def statvfs(path):  # the SSD directories' disk only: the arena's /dev/shm is sized for real
        if not str(path).startswith(str(tmp_path)):
            return real_statvfs(path)
        return type("St", (), {"f_bavail": 50, "f_frsize": BB + 64})()  # 50 block files free

    monkeypatch.setattr(os, "statvfs", statvfs)
    pools = [pool(tmp_path / f"worker-{i}", shared_by=3) for i in range(3)]
    try:
        assert [ssd_blocks(s) for s in pools] == [15] * 3  # 50 less a tenth, in three: one pool alone took 45
        assert "its share: 1/3 of the free space" in caplog.text
        for key in (1, 2, 3, 4):  # DRAM holds 2: two spill
            put(pools[0], [key])
    finally:
        for s in pools:
            s.close()
    again = pool(tmp_path / "worker-0", shared_by=3)  # a worker restarted: its own files are its own
    try:
        assert ssd_blocks(again) == 2 + 15 and again.lookup([1, 2]) == ["ssd", "ssd"]
    finally:
        again.close()


def test_pools_sharing_a_real_small_disk_never_fill_it(tmp_path):
    """Three pools on a tmpfs of 512 KiB: each starts at a third of its free space less a tenth,
    and filling all three tiers never runs the disk out (before, each took nine tenths of it,
    and the full disk shrank them afterwards: `ssd_errors_full`)."""
    target = tmp_path / "disk"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs",
                                            str(target)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    block_bytes = 8192 - 64  # a block file fills two pages exactly: the free space counts whole files
    pools = []
    try:
        pools = [pool(target / f"worker-{i}", shared_by=3, block_bytes=block_bytes) for i in range(3)]
        for s in pools:
            for key in range(1, 40):
                for k, slot in s.reserve([key]):
                    s.arena.slot(slot)[:] = k % 251
                s.commit([key])
            s.flush()
        counters = [s.stats()["counters"] for s in pools]
        assert [c.get("ssd_errors_full", 0) for c in counters] == [0, 0, 0], counters
        files = sum(ssd_blocks(s) for s in pools)
        assert all(s.stats()["ssd_enabled"] for s in pools) and files * 8192 <= 0.9 * (512 << 10)
    finally:
        for s in pools:
            s.close()
        subprocess.run(["umount", str(target)])
