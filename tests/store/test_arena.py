"""The DRAM tier's arena: sized to the shared memory left (other arenas' untaken pages counted as
used), and stale arenas of dead processes removed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from store.arena import Arena
from tests.store.service_support import BB


def test_an_arena_larger_than_the_free_shared_memory_shrinks_to_fit(tmp_path, monkeypatch, caplog):
    """A write past what tmpfs holds would kill the writer with SIGBUS (the file is sparse, so
    creating it succeeds): the arena takes the slots that fit, and a pool with room for none is
    an error its connectors run without."""
    import types

    import store.arena as arena_module

    free = [int(4.5 * BB / (1 - arena_module.SHM_HEADROOM)) + 1]  # room for 4 blocks, with the headroom
    real = os.statvfs
    monkeypatch.setattr(arena_module.os, "statvfs", lambda d: types.SimpleNamespace(
        f_bavail=free[0], f_frsize=1) if d == str(tmp_path) else real(d))
    with caplog.at_level(logging.WARNING):
        arena = Arena.create(16, BB, directory=str(tmp_path))
    assert arena.slots == 4 and "room for 4 of the 16" in caplog.text
    arena.slot(3)[:] = 1  # the last slot is writable
    arena.close()
    free[0] = BB // 2
    with pytest.raises(OSError, match="less than one"):
        Arena.create(16, BB, directory=str(tmp_path))


def test_a_second_arena_counts_the_first_ones_untaken_pages_as_used(tmp_path, monkeypatch):
    """Two pools on one host (serve's prefill and decode workers): the first arena's sparse pages
    are free until written, but promised. Each used to be given the same free space, and filling
    both killed a writer with SIGBUS; the second now gets what is left, or a clear error."""
    import types

    import store.arena as arena_module

    free = int(10 * BB / (1 - arena_module.SHM_HEADROOM)) + 1  # room for 10 blocks, with the headroom
    real = os.statvfs
    monkeypatch.setattr(arena_module.os, "statvfs", lambda d: types.SimpleNamespace(
        f_bavail=free, f_frsize=1) if d == str(tmp_path) else real(d))  # the first's pages: still free
    first = Arena.create(6, BB, directory=str(tmp_path))
    second = Arena.create(6, BB, directory=str(tmp_path))
    assert (first.slots, second.slots) == (6, 4)
    with pytest.raises(OSError, match="promised to other KV pools"):
        Arena.create(6, BB, directory=str(tmp_path))
    first.slot(5)[:] = 1  # written pages are no longer promised (the fake statvfs does not see them go)
    assert arena_module.promised_bytes(str(tmp_path)) < 10 * BB
    first.close()
    second.close()


def test_stale_arena_of_a_dead_process_is_removed(tmp_path):
    from store.arena import PREFIX, remove_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{PREFIX}{dead.stdout.strip()}-abcd"
    stale.write_bytes(b"x")
    fresh = tmp_path / f"{PREFIX}{dead.stdout.strip()}-beef"  # its creator may not hold the lock yet
    fresh.write_bytes(b"x")
    os.utime(stale, (1e9, 1e9))
    alive = Arena.create(2, 64, directory=str(tmp_path))
    # Another PID namespace's live pool (a container sharing /dev/shm): the pid in its name is
    # nobody here, but its creator holds the file's lock.
    elsewhere = Arena.create(2, 64, directory=str(tmp_path))
    foreign_name = str(tmp_path / f"{PREFIX}{dead.stdout.strip()}-cafe")
    os.rename(elsewhere.info.path, foreign_name)
    for path in (alive.info.path, foreign_name):
        os.utime(path, (1e9, 1e9))
    try:
        remove_stale(str(tmp_path))
        assert not stale.exists() and fresh.exists()
        assert os.path.exists(alive.info.path) and os.path.exists(foreign_name)
    finally:
        alive.close()
        elsewhere.close()
    assert not os.path.exists(alive.info.path)
