"""PoolService's SSD tier: restart, limits, corrupt files, disk faults, spills in flight, and one
directory per pool."""

from __future__ import annotations

import errno
import logging
import os
import subprocess

import pytest

from store.config import PoolConfig
from store.pool import checksum
from store.service import PoolService
from store.ssd import HEADER, SsdTier
from tests.store.service_support import BB, LAYOUT, data, held_bytes, put, service


def on_disk(s: PoolService, key: int) -> bool:
    """Block `key`'s file holds its bytes (read without promoting it: a promotion's spill would
    evict another block from the tier)."""
    out = bytearray(BB)
    return s.ssd.read_into(key, out, checksum(data(key))) and bytes(out) == data(key).tobytes()


def test_restart_rebuilds_the_ssd_index(tmp_path):
    first = service(tmp_path)
    for key in range(1, 9):
        put(first, [key])
    first.close()  # spills queued are written before it returns
    second = service(tmp_path)
    try:
        assert second.lookup(list(range(1, 5))) == ["ssd"] * 4
        assert held_bytes(second, list(range(1, 5))) == [True] * 4
        assert second.events_since(-1).reset
    finally:
        second.close()


def test_a_smaller_ssd_tier_keeps_the_newest_files_and_other_layouts_are_named(tmp_path, caplog):
    first = service(tmp_path)
    for key in range(1, 9):
        put(first, [key])
    first.close()  # keys 1-4 are on SSD
    for age, key in enumerate((4, 3, 2, 1)):  # key 1 newest
        os.utime(first.ssd.path(key), (1e9 + age * 100, 1e9 + age * 100))
    stale = SsdTier(str(tmp_path / "ssd"), "another-model/bfloat16", BB)
    stale.open()
    stale.write(99, data(99).tobytes(), checksum(data(99)))
    with caplog.at_level(logging.WARNING):
        second = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=2 * BB),
                             remote=False).start()
        second.configure(BB, LAYOUT)
    try:
        assert [second.lookup([key]) for key in range(1, 5)] == [["ssd"], ["ssd"], [], []]
        assert not os.path.exists(second.ssd.path(3))  # deleted, beyond the smaller tier
        assert "other KV layouts" in caplog.text and stale.root in caplog.text
    finally:
        second.close()


def test_corrupt_block_on_disk_is_a_counted_miss(svc, caplog):
    for key in range(1, 6):
        put(svc, [key])
    svc.flush()
    assert svc.lookup([1]) == ["ssd"]
    path = svc.ssd.path(1)
    with open(path, "r+b") as f:
        f.seek(HEADER.size + 5)
        f.write(b"\x00\x01\x02")
    with caplog.at_level(logging.WARNING):
        assert svc.read([1, 2]) == []  # the run stops at the bad block; the caller recomputes
    assert "fails its checksum" in caplog.text
    assert svc.stats()["counters"]["corrupt"] == 1
    svc.flush()  # the file's deletion is queued behind the writes
    assert svc.lookup([1]) == [] and not os.path.exists(path)
    assert held_bytes(svc, [2]) == [True]


def test_unusable_directory_degrades_to_dram_only(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    with caplog.at_level(logging.WARNING):
        s = service(ssd_dir=str(tmp_path / "file" / "ssd"))
    try:
        assert "DRAM only" in caplog.text
        assert s.stats()["counters"]["ssd_errors_unwritable"] == 1 and not s.stats()["ssd_enabled"]
        for key in range(1, 9):
            put(s, [key])
        assert s.lookup(list(range(1, 9))) == [] and s.lookup([5, 6, 7, 8]) == ["dram"] * 4
        assert held_bytes(s, [5, 6, 7, 8]) == [True] * 4
    finally:
        s.close()


def test_read_only_directory_degrades_to_dram_only(tmp_path, caplog):
    target = tmp_path / "ro"
    target.mkdir()
    if os.geteuid() == 0:  # root ignores permissions: a read-only mount is the honest test
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)]).returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        target.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            s = service(ssd_dir=str(target))
        assert "DRAM only" in caplog.text and s.stats()["counters"]["ssd_errors_unwritable"] == 1
        put(s, [1])
        assert held_bytes(s, [1]) == [True]
        s.close()
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(target)])
        else:
            target.chmod(0o700)


def test_full_disk_while_spilling_shrinks_then_degrades_without_losing_correctness(svc, monkeypatch, caplog):
    """The disk takes two files, then nothing: the tier first shrinks to the two on it (a later
    spill evicts one to write), and goes off once every write fails and none is left."""
    real_write = SsdTier.write
    writes = []

    def write(self, key, data_, digest):
        writes.append(key)
        if len(writes) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, key, data_, digest)

    monkeypatch.setattr(SsdTier, "write", write)
    with caplog.at_level(logging.WARNING):
        for key in range(1, 12):
            put(svc, [key])
            svc.flush()
    assert "shrinks from 16 to 2 blocks" in caplog.text and "DRAM only" in caplog.text
    stats = svc.stats()
    assert stats["counters"]["ssd_errors_full"] >= 2 and not stats["ssd_enabled"]
    assert stats["usage"]["ssd"]["capacity_bytes"] == 0
    assert svc.lookup([8, 9, 10, 11]) == ["dram"] * 4
    assert held_bytes(svc, [8, 9, 10, 11]) == [True] * 4
    assert svc.lookup([1]) == []  # what was on disk is no longer offered


def test_a_disk_that_fills_keeps_the_tier_at_what_fits(svc, monkeypatch, caplog):
    """Another process takes the disk's room once three of our files are on it: the tier holds
    three from then on, each spill replacing the oldest, and stays on."""
    real_write = SsdTier.write
    full = {"on": False}

    def write(self, key, data_, digest):
        files = sum(name.endswith(".blk") for _, _, names in os.walk(self.root) for name in names)
        if full["on"] and files >= 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, key, data_, digest)

    monkeypatch.setattr(SsdTier, "write", write)
    with caplog.at_level(logging.WARNING):
        for key in range(1, 8):  # DRAM holds 4: keys 1-3 spill
            put(svc, [key])
            svc.flush()
        full["on"] = True
        for key in range(8, 16):
            put(svc, [key])
            svc.flush()
    stats = svc.stats()
    assert stats["ssd_enabled"] and stats["usage"]["ssd"]["capacity_bytes"] == 3 * BB
    assert "shrinks from 16 to 3 blocks" in caplog.text and "DRAM only" not in caplog.text
    on_ssd = [key for key in range(1, 16) if svc.lookup([key]) == ["ssd"]]
    assert len(on_ssd) == 3 and on_ssd[-1] == 11  # the newest spills, each the oldest's place
    assert all(on_disk(svc, key) for key in on_ssd)


def test_a_tier_bigger_than_the_free_disk_is_cut_to_it_at_start(tmp_path, monkeypatch, caplog):
    """--pool-ssd-gib beyond the disk's free space would fill the disk: the tier starts at what
    fits (leaving a tenth of the free space), with a warning."""
    real_statvfs, free = os.statvfs, {"blocks": 5}

    def statvfs(path):  # the SSD directory's disk only: the arena's /dev/shm is sized for real
        if not str(path).startswith(str(tmp_path)):
            return real_statvfs(path)
        return type("St", (), {"f_bavail": free["blocks"], "f_frsize": 10 * (BB + 64)})()

    monkeypatch.setattr(os, "statvfs", statvfs)
    with caplog.at_level(logging.WARNING):
        s = service(tmp_path, ssd_blocks=1000)
    try:
        assert s.stats()["usage"]["ssd"]["capacity_bytes"] == 45 * BB
        assert "room for 45 blocks" in caplog.text
    finally:
        s.close()
    free["blocks"] = 0  # no room at all: off, said, not on with nothing
    with caplog.at_level(logging.WARNING):
        s = service(tmp_path / "other", ssd_blocks=1000)
    try:
        assert not s.stats()["ssd_enabled"] and "no room for a block" in caplog.text
        put(s, list(range(1, 9)))  # DRAM only: nothing spills, nothing fails
    finally:
        s.close()


def test_a_file_the_restart_cannot_delete_is_left_and_the_pool_starts(tmp_path, monkeypatch, caplog):
    first = service(tmp_path)
    for key in range(1, 9):
        put(first, [key])
    first.close()  # keys 1-4 are on SSD

    def refuse(self, key):
        raise PermissionError(errno.EPERM, "Operation not permitted", self.path(key))

    monkeypatch.setattr(SsdTier, "delete", refuse)
    with caplog.at_level(logging.WARNING):
        second = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=2 * BB),
                             remote=False).start()
        second.configure(BB, LAYOUT)  # raised PermissionError: the worker ran without a pool
    try:
        assert second.stats()["ssd_enabled"]
        assert sum(second.lookup([key]) == ["ssd"] for key in range(1, 5)) == 2
        assert "cannot delete" in caplog.text
    finally:
        second.close()


def test_a_real_small_filesystem_holds_what_fits(tmp_path, caplog):
    """A tmpfs of 64 KiB holds a few 8 KiB blocks: the tier is cut to them at start, and the
    disk's real fullness never turns it off."""
    target = tmp_path / "tiny"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(target)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    s = None
    try:
        with caplog.at_level(logging.WARNING):
            s = service(ssd_dir=str(target), dram_blocks=2, ssd_blocks=64)
            for key in range(1, 30):
                put(s, [key])
                s.flush()
        # It started at what the disk holds, and stays on: each spill replaces the oldest file.
        assert "room for" in caplog.text and s.stats()["ssd_enabled"]
        on_ssd = [key for key in range(1, 30) if s.lookup([key]) == ["ssd"]]
        assert on_ssd and all(on_disk(s, key) for key in on_ssd)
        assert held_bytes(s, [28, 29]) == [True, True]
    finally:
        if s is not None:
            s.close()
        subprocess.run(["umount", str(target)])


def test_a_spill_still_on_its_way_to_disk_is_served_from_its_copy(svc, monkeypatch):
    import threading

    real_write = SsdTier.write
    gate = threading.Event()

    def slow_write(self, key, data_, digest):
        gate.wait(10)
        real_write(self, key, data_, digest)

    monkeypatch.setattr(SsdTier, "write", slow_write)
    for key in range(1, 6):
        put(svc, [key])  # 1 is spilled, its write held at the gate
    assert svc.lookup([1]) == ["ssd"]
    assert held_bytes(svc, [1]) == [True]  # promoted from the in-memory copy, checksum verified
    gate.set()
    svc.flush()
    assert svc.stats()["counters"]["corrupt"] == 0


def test_a_second_pool_on_the_same_ssd_directory_runs_dram_only(tmp_path, caplog):
    # Sharing one directory, each pool restored the other's files as its own and evicted them,
    # and the disk held twice the limit.
    first = service(tmp_path)
    try:
        with caplog.at_level(logging.WARNING):
            second = service(tmp_path)
        try:
            assert first.ssd is not None and second.ssd is None
            assert "in use by another KV pool" in caplog.text
        finally:
            second.close()
        third = service(tmp_path)  # the second held nothing: still refused while the first lives
        assert third.ssd is None
        third.close()
    finally:
        first.close()
    again = service(tmp_path)  # the first let it go
    assert again.ssd is not None
    again.close()


def test_an_ssd_tier_too_small_for_one_block_is_off_with_a_warning(tmp_path, caplog):
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=BB // 2),
                    remote=False).start()
    s.configure(BB, LAYOUT)
    try:
        assert s.ssd is None and s.stats()["ssd_enabled"] is False
        assert any("cannot hold one block" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    finally:
        s.close()
