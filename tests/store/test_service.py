"""PoolService with its arena, SSD tier and local channel (no messenger: remote=False)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from store.arena import Arena
from store.channel import PoolClient, PoolUnavailable
from store.config import PoolConfig
from store.pool import checksum
from store.service import PoolService
from store.ssd import HEADER, SsdTier

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


@pytest.fixture
def svc(tmp_path):
    s = service(tmp_path)
    yield s
    s.close()


def test_another_process_maps_the_arena_and_saves_through_the_channel(svc):
    """What vLLM's worker does: attach the arena by path, fill reserved slots, commit."""
    endpoint = svc.endpoint
    code = textwrap.dedent(f"""
        import numpy as np
        from mooncake.control import ControlEndpoint
        from store.arena import Arena
        from store.channel import PoolClient
        from store.pool import checksum
        client = PoolClient(ControlEndpoint({endpoint.path!r}, {endpoint.authkey_hex!r}))
        arena = Arena.attach(client.configure({BB}, {LAYOUT!r}))
        slots = client.reserve([11, 12])
        for key, slot in slots:
            arena.slot(slot)[:] = np.random.default_rng(key).integers(0, 256, {BB}, dtype=np.uint8)
        print(client.commit([k for k, _ in slots], [checksum(arena.slot(s)) for _, s in slots]))
        print(client.lookup([11, 12, 13]))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["2", "['dram', 'dram']"]
    assert held_bytes(svc, [11, 12]) == [True, True]


def test_client_roundtrip_pins_and_releases(svc):
    client = PoolClient(svc.endpoint)
    try:
        assert client.lookup([1]) == []
        slots = client.reserve([1, 2])
        for key, slot in slots:
            svc.arena.slot(slot)[:] = data(key)
        assert client.commit([1], wait=False) is None
        assert client.commit([2]) == 1  # the service hashes the slots
        assert client.lookup([1, 2]) == ["dram", "dram"]
        got = client.read([1, 2, 3])
        assert [(k, c) for k, _, c in got] == [(1, checksum(data(1))), (2, checksum(data(2)))]
        assert svc.pool.pins(1) == 1
        client.release([1, 2])  # sent without an answer; the next call on the connection sees it done
        client.lookup([1])
        assert svc.pool.pins(1) == 0
        client.read([1])
        assert svc.stats()["usage"]["dram"]["blocks"] == 2
        with pytest.raises(PoolUnavailable, match="unknown pool op"):
            client._call({"op": "nonsense"})
        with pytest.raises(PoolUnavailable, match="layout"):
            client.configure(BB, "another-model")
    finally:
        client.close()
    # The connection is gone: its pins go with it.
    for _ in range(100):
        if svc.pool.pins(1) == 0:
            break
        import time
        time.sleep(0.01)
    assert svc.pool.pins(1) == 0


def test_a_release_naming_a_key_twice_takes_only_the_pins_its_connection_holds(svc):
    a, b = PoolClient(svc.endpoint), PoolClient(svc.endpoint)
    try:
        put(svc, [1])
        a.read([1])
        b.read([1])
        assert svc.pool.pins(1) == 2
        b.release([1, 1])  # b holds one pin: a's must stay, or the block could go mid-copy
        b.lookup([1])  # a round trip: the release is applied
        assert svc.pool.pins(1) == 1
    finally:
        a.close()
        b.close()


def test_wrong_key_is_refused(svc):
    from mooncake.control import ControlEndpoint

    with pytest.raises(PoolUnavailable):
        PoolClient(ControlEndpoint(svc.endpoint.path, "00" * 16)).lookup([1])


def test_eviction_spills_and_a_read_promotes_the_same_bytes(svc):
    keys = list(range(1, 11))
    for key in keys:
        put(svc, [key])
    svc.flush()
    tiers = svc.lookup(keys)
    assert tiers == ["ssd"] * 6 + ["dram"] * 4
    assert held_bytes(svc, keys[:4]) == [True] * 4  # promoted, each verified
    assert held_bytes(svc, keys) == [True] * 4  # 4 DRAM slots: a pinned read stops when they are all pinned
    for i in range(0, 10, 2):
        assert held_bytes(svc, keys[i:i + 2]) == [True, True]
    assert svc.stats()["counters"]["promotions"] >= 6


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_tiers_under_pressure_never_lose_a_block_the_index_holds(tmp_path, policy):
    """Both tiers small and full, so one call evicts from SSD and spills again, and promotions
    find the SSD tier's own victim: whatever the index still holds reads back intact. (Deletes
    were queued after the plan's spills, which removed a file just written again; a promotion
    could evict the very file it read.)"""
    config = PoolConfig(dram_bytes=2 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=2 * BB, policy=policy)
    s = PoolService(config, remote=False).start()
    s.configure(BB, LAYOUT)
    try:
        for round_ in range(12):
            put(s, [round_ * 2 + 1, round_ * 2 + 2])
            s.flush()
            for key in range(1, round_ * 2 + 3):
                if s.lookup([key]):
                    assert held_bytes(s, [key]) == [True], (policy, round_, key)
                    s.flush()
        assert s.stats()["counters"]["corrupt"] == 0
    finally:
        s.close()


def test_a_promotion_that_raises_leaves_no_slot_loading_and_no_pin(svc, monkeypatch):
    """Anything a promotion raises (the tier turned off under it, a bug) ends the read with the
    error, but the slot leaves LOADING and the blocks read before it are unpinned."""
    keys = list(range(1, 9))
    for key in keys:
        put(svc, [key])
    svc.flush()
    assert svc.lookup(keys[:2]) == ["ssd", "ssd"] and svc.lookup(keys[4:]) == ["dram"] * 4
    real = svc.ssd.read_into
    monkeypatch.setattr(svc.ssd, "read_into", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        svc.read([keys[4], keys[0]])  # a DRAM block, then one that must be promoted
    assert svc.pool.pins(keys[4]) == 0
    monkeypatch.setattr(svc.ssd, "read_into", real)
    assert held_bytes(svc, keys[4:]) == [True] * 4  # every slot usable: nothing stuck pinned or loading


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


def test_full_disk_while_spilling_degrades_without_losing_correctness(svc, monkeypatch, caplog):
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
    assert "DRAM only" in caplog.text
    stats = svc.stats()
    assert stats["counters"]["ssd_errors_full"] == 1 and not stats["ssd_enabled"]
    assert stats["usage"]["ssd"]["capacity_bytes"] == 0
    assert svc.lookup([8, 9, 10, 11]) == ["dram"] * 4
    assert held_bytes(svc, [8, 9, 10, 11]) == [True] * 4
    assert svc.lookup([1]) == []  # what was on disk is no longer offered


def test_a_real_full_filesystem_degrades(tmp_path, caplog):
    """A tmpfs of 64 KiB holds a few 8 KiB blocks, then the disk is really full."""
    target = tmp_path / "tiny"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(target)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        s = service(ssd_dir=str(target), dram_blocks=2, ssd_blocks=64)
        with caplog.at_level(logging.WARNING):
            for key in range(1, 30):
                put(s, [key])
                s.flush()
        assert "DRAM only" in caplog.text and s.stats()["counters"]["ssd_errors_full"] >= 1
        assert held_bytes(s, [28, 29]) == [True, True]
        s.close()
    finally:
        subprocess.run(["umount", str(target)])


def test_events_page_orders_stored_and_removed_per_tier(svc):
    put(svc, [1])
    page = svc.events_since(-1)
    assert page.reset and page.events == [("stored", 1, "dram")]
    for key in range(2, 7):
        put(svc, [key])
    svc.flush()
    later = svc.events_since(page.seq)
    assert not later.reset
    assert ("removed", 1, "dram") in later.events and ("stored", 1, "ssd") in later.events
    assert later.events.index(("removed", 1, "dram")) < later.events.index(("stored", 1, "ssd"))


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


def test_concurrent_connectors_never_read_wrong_bytes(tmp_path):
    """Four connectors save and load overlapping keys through spills and promotions at once;
    every block read must be the block saved under its key."""
    import random
    import threading

    s = service(tmp_path, dram_blocks=8, ssd_blocks=24)
    errors, reads = [], [0]

    def connector(seed):
        rng = random.Random(seed)
        client = PoolClient(s.endpoint)
        arena = Arena.attach(client.configure(BB, LAYOUT))
        try:
            for _ in range(150):
                keys = [rng.randrange(40) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.5:
                    slots = client.reserve(keys)
                    for key, slot in slots:
                        arena.slot(slot)[:] = data(key)
                    client.commit([k for k, _ in slots], [checksum(data(k)) for k, _ in slots])
                else:
                    got = client.read(keys)
                    for key, slot, digest in got:
                        if digest != checksum(data(key)) or not np.array_equal(arena.slot(slot), data(key)):
                            errors.append(key)
                        reads[0] += 1
                    client.release([k for k, _, _ in got])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=connector, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and reads[0] > 20
        stats = s.stats()
        assert stats["counters"]["spills"] > 0 and stats["counters"]["corrupt"] == 0
    finally:
        s.close()


def test_a_configure_that_fails_part_way_leaves_no_half_configured_pool(tmp_path, monkeypatch):
    # The messenger side failing to start (a port taken) used to leave the arena and index up: the
    # next configure then answered as if the pool were whole, with no remote side for good.
    import store.remote

    def refuse(self, service, engine_config=None):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(store.remote.RemotePool, "__init__", refuse)
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=4 * BB),
                    remote=True).start()
    try:
        for _ in range(2):  # every try fails the same way, and holds nothing after
            with pytest.raises(OSError, match="Address already in use"):
                s.configure(BB, LAYOUT)
            assert s.arena is None and s.pool is None and s.ssd is None and s.lookup([1]) == []
        monkeypatch.undo()
        s._want_remote = False
        s.configure(BB, LAYOUT)  # and it can still be configured once the cause is gone
        assert s.arena is not None and s.ssd is not None
    finally:
        s.close()


def test_configure_may_take_longer_than_a_call(tmp_path, monkeypatch):
    # The first configure rebuilds the SSD index (a header read per file: seconds for a full tier
    # on a cold disk); under the 2 s of an ordinary call the engine ran without the pool for good.
    # The copier gives it the load timeout (kv_connector/pool_copier.py).
    slow_open = PoolService._open_ssd

    def slow(self):
        time.sleep(0.5)
        slow_open(self)

    monkeypatch.setattr(PoolService, "_open_ssd", slow)
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=4 * BB),
                    remote=False).start()
    client = PoolClient(s.endpoint, timeout_s=0.1)
    try:
        info = client.configure(BB, LAYOUT, timeout_s=10.0)
        assert info.slots == 4 and client.lookup([1]) == []
    finally:
        client.close()
        s.close()


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
