"""Remote gets between two processes through the messenger (tcp on loopback)."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from messenger.api import PeerInfo, TransferError
from store.config import PoolConfig
from store.remote import INLINE_BYTES
from store.service import PoolService
from tests.processes import ROOT
from tests.store.pool_peer import ENGINE, LAYOUT, MARK, block_data


def start_peer(block_bytes: int, blocks: int, keys: list[int]):
    proc = subprocess.Popen([sys.executable, "-m", "tests.store.pool_peer", str(block_bytes), str(blocks),
                             *map(str, keys)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith(MARK):
            return proc, msgspec.json.decode(line[len(MARK):], type=PeerInfo)
    raise AssertionError("the peer pool did not start")


def stop_peer(proc) -> None:
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def local_pool(block_bytes: int, blocks: int, mapped: bool = False, **kwargs) -> PoolService:
    """A pool fetching over the messenger, or (`mapped`) out of a same-host peer's arena."""
    kwargs.setdefault("engine_config", ENGINE)
    config = PoolConfig(dram_bytes=blocks * block_bytes, ssd_dir=None, map_same_host_peers=mapped)
    service = PoolService(config, **kwargs).start()
    service.configure(block_bytes, LAYOUT)
    return service


def verify(service: PoolService, keys) -> bool:
    got = service.read(keys)
    try:
        return len(got) == len(keys) and all(
            np.array_equal(service.arena.slot(slot), block_data(key, service.config.block_bytes))
            for key, slot, _ in got)
    finally:
        service.release([k for k, _, _ in got])


@pytest.mark.parametrize("block_bytes,mapped", [(32 << 10, False), (1 << 20, False), (32 << 10, True)],
                         ids=["inline-32KiB", "push-1MiB", "same-host-arena"])
def test_fetch_from_another_process(block_bytes, mapped):
    keys = [2**127 + i for i in range(6)]  # 128-bit keys, the hashing function's size
    proc, peer = start_peer(block_bytes, 8, keys[:5])  # the peer holds the first 5
    local = local_pool(block_bytes, 16, mapped=mapped)
    try:
        assert (len(keys[:5]) * block_bytes <= INLINE_BYTES) == (block_bytes == 32 << 10)
        assert local.fetch_remote(peer, keys) == 5  # the leading run the peer holds
        assert local.lookup(keys) == ["dram"] * 5
        assert verify(local, keys[:5])
        assert local.stats()["counters"]["remote_fetched_blocks"] == 5
        assert local.fetch_remote(peer, keys[:3]) == 3  # held here now: nothing moves
        assert local.stats()["counters"]["remote_fetched_blocks"] == 5
        assert bool(local.remote._peer_arenas._mapped) == mapped
    finally:
        local.close()
        stop_peer(proc)


@pytest.mark.parametrize("block_bytes,mapped", [(32 << 10, False), (1 << 20, False), (32 << 10, True)],
                         ids=["inline-32KiB", "push-1MiB", "same-host-arena"])
def test_a_peer_of_another_kv_layout_is_refused_and_nothing_is_stored(block_bytes, mapped):
    """Blocks of equal size but another model or dtype would land as valid foreign KV: the
    holder refuses a fetch whose layout differs from its own."""
    keys = [2**127 + i for i in range(3)]
    proc, peer = start_peer(block_bytes, 8, keys)
    config = PoolConfig(dram_bytes=16 * block_bytes, ssd_dir=None, map_same_host_peers=mapped)
    local = PoolService(config, engine_config=ENGINE).start()
    local.configure(block_bytes, LAYOUT + "-other-dtype")
    try:
        with pytest.raises(Exception, match="layout"):
            local.fetch_remote(peer, keys)
        assert local.lookup(keys) == [] and local.pool.reserved_slots(keys) == []
    finally:
        local.close()
        stop_peer(proc)


def test_fetch_through_the_local_channel():
    """What the connector does for Algorithm 1's fetch_from: ask its own node's pool."""
    from store.channel import PoolClient

    keys = [21, 22]
    proc, peer = start_peer(64 << 10, 4, keys)
    local = local_pool(64 << 10, 4)
    client = PoolClient(local.endpoint)
    try:
        assert client.fetch_remote(msgspec.json.encode(peer), keys + [23]) == 2
        assert client.lookup(keys) == ["dram", "dram"] and verify(local, keys)
    finally:
        client.close()
        local.close()
        stop_peer(proc)


def test_one_sided_read_with_pins_is_the_fallback():
    """When the peer cannot write to us, blocks are pinned there and read one-sidedly."""
    block_bytes, keys = 1 << 20, [11, 12, 13]
    proc, peer = start_peer(block_bytes, 4, keys)
    local = local_pool(block_bytes, 4)
    try:
        local.remote.engine.add_peer(peer)
        local.remote._fetch_by_read(peer.name, keys)
        assert local.lookup(keys) == ["dram"] * 3 and verify(local, keys)
    finally:
        local.close()
        stop_peer(proc)


def test_a_dead_peer_fails_within_the_timeout():
    from messenger.engine import EngineConfig

    proc, peer = start_peer(64 << 10, 4, [1, 2])
    local = local_pool(64 << 10, 4, engine_config=EngineConfig(transports=("tcp",), timeout_s=2.0, checksums=False))
    try:
        proc.kill()
        proc.wait()
        started = time.monotonic()
        with pytest.raises(TransferError):
            local.fetch_remote(peer, [1, 2])
        assert time.monotonic() - started < 10
        assert local.lookup([1, 2]) == []
    finally:
        local.close()
        stop_peer(proc)


def test_slots_of_a_failed_transfer_are_quarantined_before_reuse():
    """A peer that answers late could still write into the slots: they stay reserved a while."""
    from messenger.engine import EngineConfig

    local = local_pool(1 << 20, 2, engine_config=EngineConfig(transports=("tcp",), timeout_s=0.5, checksums=False))
    try:
        local.remote._quarantine([k for k, _ in local.reserve([5, 6])])
        assert local.reserve([7]) == []  # both slots still held
        deadline = time.monotonic() + 5  # they come back after twice the timeout (1 s)
        while not (got := local.reserve([7])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [k for k, _ in got] == [7]
    finally:
        local.close()


def test_pins_of_a_peer_that_never_releases_expire():
    clock = [0.0]
    server = PoolService(PoolConfig(dram_bytes=4 << 10, ssd_dir=None, pin_lease_s=5.0), clock=lambda: clock[0],
                         engine_config=ENGINE)
    server.start()
    server.configure(1 << 10, LAYOUT)
    try:
        server.reserve([7])
        server.commit([7])
        from store import channel

        layout = server.remote.layout_id
        reply = channel.decode(server.remote._on_call("peer", channel.encode(
            {"op": "pin", "keys": channel.pack_keys([7]), "layout": layout})))
        assert reply["ok"] and server.pool.pins(7) == 1
        clock[0] = 6.0
        server.remote._on_call("peer", channel.encode({"op": "unpin", "leases": [999]}))  # any call sweeps
        assert server.pool.pins(7) == 0
        # ...a get (answered inline, apart from the other calls) too, and the local saves' reserve
        for sweep in (lambda: server.remote._on_call("peer", channel.encode(
                          {"op": "get", "keys": channel.pack_keys([8]), "layout": layout})).done(),
                      lambda: server.reserve([9])):
            server.remote._on_call("peer", channel.encode({"op": "pin", "keys": channel.pack_keys([7]),
                                                           "layout": layout}))
            assert server.pool.pins(7) == 1
            clock[0] += 6.0
            sweep()
            assert server.pool.pins(7) == 0
        bad = channel.decode(server.remote._on_call("peer", b"\x01garbage"))
        assert not bad["ok"]
    finally:
        server.close()


def test_blocks_on_the_peers_ssd_are_promoted_and_sent_in_several_calls(tmp_path):
    """The holder keeps 2 blocks in DRAM and the rest on SSD; a fetch of 6 needs several calls
    (each pins what fits) and every block arrives intact."""
    block_bytes, keys = 1 << 20, list(range(100, 106))
    holder = PoolService(PoolConfig(dram_bytes=2 * block_bytes, ssd_dir=str(tmp_path), ssd_bytes=16 * block_bytes),
                         engine_config=ENGINE)
    holder.start()
    holder.configure(block_bytes, LAYOUT)
    local = local_pool(block_bytes, 8)
    try:
        for key in keys:
            for k, slot in holder.reserve([key]):
                holder.arena.slot(slot)[:] = block_data(k, block_bytes)
            holder.commit([key])
        holder.flush()
        assert holder.lookup(keys) == ["ssd"] * 4 + ["dram"] * 2
        assert local.fetch_remote(holder.peer_info(), keys) == 6
        assert verify(local, keys[:4]) and verify(local, keys[4:])
        assert holder.stats()["counters"]["promotions"] >= 4
    finally:
        local.close()
        holder.close()


def _holder(block_bytes: int, keys: list[int]) -> PoolService:
    holder = PoolService(PoolConfig(dram_bytes=8 * block_bytes, ssd_dir=None), engine_config=ENGINE).start()
    holder.configure(block_bytes, LAYOUT)
    for key in keys:
        for k, slot in holder.reserve([key]):
            holder.arena.slot(slot)[:] = block_data(k, block_bytes)
        holder.commit([key])
    return holder


@pytest.mark.parametrize("mapped", [False, True], ids=["call-reply", "same-host-arena"])
def test_a_block_corrupted_at_the_holder_is_dropped_not_served(mapped):
    """The bytes ride the call's reply straight into reserved slots, or are copied out of the
    holder's arena; the checksum the holder's index holds is checked before anything is
    committed here, and the holder's pins all go back."""
    block_bytes, keys = 32 << 10, [21, 22, 23]
    holder = _holder(block_bytes, keys)
    local = local_pool(block_bytes, 8, mapped=mapped)
    try:
        got = holder.read([22])
        holder.arena.slot(got[0][1])[100] ^= 0xFF  # flipped after its checksum was taken
        holder.release([22])
        assert local.fetch_remote(holder.peer_info(), keys) == 1  # 21 only: 22 failed, so the run ends
        assert local.lookup(keys) == ["dram"]
        assert local.stats()["counters"]["remote_corrupt"] >= 1 and verify(local, keys[:1])
        deadline = time.monotonic() + 5
        while any(holder.pool.pins(k) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.01)  # the arena's reader sends its pins back shortly after
        assert [holder.pool.pins(k) for k in keys] == [0, 0, 0]
    finally:
        local.close()
        holder.close()


@pytest.mark.parametrize("mapped", [False, True], ids=["call-reply", "same-host-arena"])
def test_a_fetch_larger_than_the_free_room_here_keeps_what_fits(mapped):
    block_bytes, keys = 32 << 10, [31, 32, 33, 34]
    holder = _holder(block_bytes, keys)
    local = local_pool(block_bytes, 2, mapped=mapped)  # room for two
    try:  # and no second call evicting them for the other two
        assert local.fetch_remote(holder.peer_info(), keys) == 2
        assert local.lookup(keys) == ["dram", "dram"] and verify(local, keys[:2])
    finally:
        local.close()
        holder.close()


def test_an_arena_that_is_not_the_peers_here_falls_back_to_the_socket(monkeypatch):
    """Another /dev/shm (a container of its own): the same path names another file here."""
    from store import remote

    real = remote.describe
    monkeypatch.setattr(remote, "describe", lambda arena: {**real(arena), "ino": real(arena)["ino"] + 1})
    block_bytes, keys = 32 << 10, [41, 42]
    holder = _holder(block_bytes, keys)
    local = local_pool(block_bytes, 8, mapped=True)
    try:
        assert local.fetch_remote(holder.peer_info(), keys) == 2 and verify(local, keys)
        assert local.remote._peer_arenas.refused(holder.peer_info().name)
        assert not local.remote._peer_arenas._mapped
    finally:
        local.close()
        holder.close()


def test_released_pins_ride_the_next_call_or_go_on_their_own():
    from store.peer_arena import RELEASE_AFTER_S, PendingReleases

    sent = []
    releases = PendingReleases(lambda peer, leases: sent.append((peer, leases)))
    try:
        releases.add("a", 1)
        releases.add("a", 2)
        assert releases.take("a") == [1, 2]  # a call carried them
        releases.add("b", 3)
        deadline = time.monotonic() + RELEASE_AFTER_S * 100
        while not sent and time.monotonic() < deadline:  # its timer, RELEASE_AFTER_S from now
            time.sleep(RELEASE_AFTER_S / 5)
        time.sleep(RELEASE_AFTER_S * 2)  # and never a second time
        assert sent == [("b", [3])] and releases.take("b") == []
    finally:
        releases.close()


def test_releases_not_delivered_go_with_a_later_call(monkeypatch):
    from store import peer_arena

    monkeypatch.setattr(peer_arena, "RELEASE_AFTER_S", 60.0)  # only a call carries them in this test
    block_bytes, keys = 32 << 10, [51, 52]
    holder = _holder(block_bytes, keys)
    local = local_pool(block_bytes, 8, mapped=True)
    try:
        assert local.fetch_remote(holder.peer_info(), keys[:1]) == 1
        assert holder.pool.pins(51) == 1  # until this side releases it
        real_call = local.remote.engine.call

        def lost(*args, **kwargs):
            raise TransferError("the lane broke")

        local.remote.engine.call = lost
        with pytest.raises(TransferError):
            local.fetch_remote(holder.peer_info(), keys)  # it carried the release, and was lost
        local.remote.engine.call = real_call
        assert holder.pool.pins(51) == 1
        assert local.fetch_remote(holder.peer_info(), keys) == 2  # the next call carries it
        assert holder.pool.pins(51) == 0
    finally:
        local.close()
        holder.close()


def test_pending_releases_after_close_are_handed_back_not_sent():
    from store.peer_arena import PendingReleases

    sent = []
    releases = PendingReleases(lambda peer, leases: sent.append((peer, leases)))
    releases.add("a", 1)
    assert releases.close() == {"a": [1]}
    releases.add("a", 2)  # a fetch finishing after close
    time.sleep(0.2)
    assert sent == [] and releases.take("a") == []


def test_the_arena_of_a_peer_that_ended_is_unmapped_when_a_new_one_is_mapped(tmp_path):
    # A restarted peer comes back under a new name with a new arena; the old mapping held the
    # dead arena's pages in /dev/shm for the life of the reader.
    from store.arena import Arena
    from store.peer_arena import PeerArenas, describe

    arenas = PeerArenas()
    first = Arena.create(2, 4096, directory=str(tmp_path))
    arenas.get("pool-host-100", describe(first))
    first.close()  # the peer ended: its file is unlinked
    second = Arena.create(2, 4096, directory=str(tmp_path))
    third = Arena.create(2, 4096, directory=str(tmp_path))
    arenas.get("pool-host-101", describe(second))
    assert arenas.mapped() == ["pool-host-101"]
    arenas.get("pool-host-102", describe(third))  # a live peer's mapping is kept
    assert arenas.mapped() == ["pool-host-101", "pool-host-102"]
    arenas.close()
    second.close()
    third.close()


def test_closing_a_pool_gives_its_shared_memory_back_and_leaves_no_thread(tmp_path):
    """The messenger's region table held a view of the arena: its map could not close, and each
    closed pool kept its shared-memory pages (and its channel's accept thread) for good."""
    import threading

    before = set(threading.enumerate())
    service = local_pool(64 << 10, 8)
    arena = service.arena
    service.close()
    assert arena._mmap.closed
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(threading.enumerate()) - before:
        time.sleep(0.05)
    assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("pool-")]
