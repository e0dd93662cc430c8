"""BlockPool: the index alone (no memory, no files), driven with an explicit clock."""

from __future__ import annotations

import random
import threading

import pytest

from store.config import PoolConfig
from store.pool import BlockPool, Tier, checksum

BB = 1024


def make(dram_blocks=4, ssd_blocks=0, policy="lru") -> BlockPool:
    return BlockPool(PoolConfig(dram_bytes=dram_blocks * BB, ssd_dir="/unused" if ssd_blocks else None,
                                ssd_bytes=ssd_blocks * BB, policy=policy, block_bytes=BB))


def put(pool: BlockPool, keys, now=0.0):
    reservation = pool.reserve(keys, now)
    got = [k for k, _ in reservation.slots]
    pool.commit(got, [k * 7 for k in got], now)
    return reservation


def spill_all(pool, plan, ok=True):
    for spill in plan.spills:
        pool.ssd_written(spill.key, ok)


def test_config_is_checked():
    with pytest.raises(ValueError, match="policy"):
        PoolConfig(policy="random")
    with pytest.raises(ValueError, match="cannot hold one block"):
        PoolConfig(dram_bytes=10, block_bytes=100)
    with pytest.raises(ValueError, match=">= 0"):
        PoolConfig(ssd_bytes=-1)
    for size in (float("nan"), 1.5, True):
        with pytest.raises(ValueError, match="whole numbers"):
            PoolConfig(dram_bytes=size)
    for lease in (float("nan"), float("inf"), 0):  # a NaN lease expired every reservation at once
        with pytest.raises(ValueError, match="finite"):
            PoolConfig(reserve_lease_s=lease)
        with pytest.raises(ValueError, match="finite"):
            PoolConfig(pin_lease_s=lease)
    with pytest.raises(ValueError, match="block_bytes"):
        BlockPool(PoolConfig())


def test_reserved_block_is_never_read_until_committed():
    pool = make()
    reservation = pool.reserve([1, 2], 0.0)
    assert [k for k, _ in reservation.slots] == [1, 2]
    assert pool.lookup([1, 2]) == []
    assert pool.read(1, 0.0) is None
    assert pool.reserve([1], 0.0).slots == []  # in flight: not handed to a second writer
    assert pool.commit([1], [11], 0.0) == [1]
    assert pool.lookup([1, 2]) == [Tier.DRAM]
    plan = pool.read(1, 0.0)
    assert (plan.slot, plan.checksum, plan.load_from_ssd) == (reservation.slots[0][1], 11, False)


def test_lookup_is_the_leading_run():
    pool = make()
    put(pool, [1, 2, 4])
    assert pool.lookup([1, 2, 3, 4]) == [Tier.DRAM, Tier.DRAM]
    assert pool.lookup([9, 1]) == []


def test_abort_frees_the_slot_and_commit_of_unknown_keys_is_skipped():
    pool = make(dram_blocks=1)
    pool.reserve([1], 0.0)
    pool.abort([1])
    assert [k for k, _ in pool.reserve([2], 0.0).slots] == [2]
    assert pool.commit([1, 2], [0, 5], 0.0) == [2]
    with pytest.raises(ValueError):
        pool.commit([1, 2], [0], 0.0)


def test_a_reservation_nobody_commits_is_freed_after_its_lease():
    pool = BlockPool(PoolConfig(dram_bytes=2 * BB, ssd_dir=None, block_bytes=BB, reserve_lease_s=60.0))
    pool.reserve([1], 0.0)  # its writer dies
    pool.reserve([2], 50.0)
    assert pool.reserve([3], 59.0).slots == []  # both slots still reserved: no room
    got = pool.reserve([3], 61.0).slots  # 1's lease ran out: its slot is free again
    assert [k for k, _ in got] == [3] and pool.counters["reservations_expired"] == 1
    assert pool.commit([1, 2], [0, 0], 61.0) == [2]  # the late commit of 1 is skipped
    assert [k for k, _ in pool.reserve([1], 200.0).slots] == [1]  # 3's lease ran out too: its slot, not 2's
    assert pool.lookup([2]) == [Tier.DRAM] and pool.counters["reservations_expired"] == 2


def test_lru_evicts_least_recently_used_and_never_pinned():
    pool = make(dram_blocks=3)
    put(pool, [1, 2, 3], now=1.0)
    pool.read(1, 2.0, pin=False)  # 1 is now the most recent; 2 the least
    put(pool, [4], now=3.0)
    assert pool.lookup([2]) == [] and pool.lookup([1]) == pool.lookup([3]) == [Tier.DRAM]
    pool.read(3, 4.0)  # pinned
    pool.pin([1])
    assert pool.reserve([5], 5.0).slots != []  # evicts 4, the only unpinned one
    assert pool.lookup([4]) == []
    assert pool.reserve([6], 6.0).slots == []  # 1 and 3 pinned, 5 reserved: no room
    pool.unpin([3])
    assert [k for k, _ in pool.reserve([6], 7.0).slots] == [6]
    assert pool.lookup([3]) == [] and pool.lookup([1]) == [Tier.DRAM]


def test_fifo_ignores_reads():
    pool = make(dram_blocks=2, policy="fifo")
    put(pool, [1, 2])
    pool.read(1, 1.0, pin=False)
    put(pool, [3], now=2.0)
    assert pool.lookup([1]) == [] and pool.lookup([2]) == [Tier.DRAM]


def test_eviction_spills_to_ssd_and_a_read_promotes_back():
    pool = make(dram_blocks=2, ssd_blocks=4)
    put(pool, [1, 2])
    reservation = put(pool, [3], now=1.0)
    assert [(s.key, s.checksum) for s in reservation.plan.spills] == [(1, 7)]
    spill_slot = reservation.plan.spills[0].slot
    assert dict(reservation.slots)[3] == spill_slot  # the victim's slot, once copied out
    assert pool.lookup([1]) == [Tier.SSD]  # not on disk yet: the owner serves its copy
    assert ("stored", 1, "ssd") not in pool.drain_events()  # announced once it is on disk
    pool.ssd_written(1, True)
    assert pool.drain_events() == [("stored", 1, "ssd")]
    assert pool.lookup([1, 2, 3]) == [Tier.SSD, Tier.DRAM, Tier.DRAM]
    plan = pool.read(1, 2.0)
    assert plan.load_from_ssd and plan.checksum == 7
    assert [s.key for s in plan.plan.spills] == [2]  # room for the promotion
    assert pool.read(1, 2.0) is None  # a second reader while it loads: a miss, not half a block
    pool.loaded(1, True, 3.0)
    spill_all(pool, plan.plan)
    assert pool.lookup([1, 2]) == [Tier.DRAM, Tier.SSD]
    pool.unpin([1])
    # Inclusive: 1 keeps its file, so evicting it again costs no write.
    reservation = put(pool, [5], now=4.0)
    assert [s.key for s in reservation.plan.spills] == [3]
    spill_all(pool, reservation.plan)
    reservation = put(pool, [6], now=5.0)
    assert reservation.plan.spills == [] and pool.lookup([1]) == [Tier.SSD]


def test_corrupt_ssd_block_is_a_miss_and_is_deleted():
    pool = make(dram_blocks=1, ssd_blocks=2)
    put(pool, [1])
    spill_all(pool, put(pool, [2]).plan)
    plan = pool.read(1, 1.0)
    assert plan.load_from_ssd
    spill_all(pool, plan.plan)
    after = pool.loaded(1, False, 1.0)
    assert after.ssd_deletes == [1]
    assert pool.lookup([1]) == []
    assert pool.counters["corrupt"] == 1
    assert pool.usage()["dram"]["used_bytes"] == 0  # the slot went back


def test_full_ssd_evicts_its_own_lru_and_lists_the_file():
    pool = make(dram_blocks=1, ssd_blocks=2)
    deletes = []
    for key in range(1, 6):
        reservation = put(pool, [key], now=float(key))
        spill_all(pool, reservation.plan)
        deletes += reservation.plan.ssd_deletes
    assert deletes == [1, 2]
    assert pool.lookup([3, 4, 5]) == [Tier.SSD, Tier.SSD, Tier.DRAM]
    assert pool.usage()["ssd"] == {"capacity_bytes": 2 * BB, "used_bytes": 2 * BB, "blocks": 2}


def test_failed_spill_and_disabled_ssd_lose_blocks_not_correctness():
    pool = make(dram_blocks=1, ssd_blocks=4)
    put(pool, [1])
    reservation = put(pool, [2])
    assert pool.ssd_written(1, False).ssd_deletes == [1]
    assert pool.lookup([1]) == []
    spill_all(pool, put(pool, [3]).plan)
    assert pool.lookup([2]) == [Tier.SSD]
    assert pool.disable_ssd().ssd_deletes == [2]
    assert pool.lookup([2]) == []
    assert put(pool, [4]).plan.spills == []  # DRAM only now
    assert pool.usage()["ssd"]["capacity_bytes"] == 0


def test_events_per_tier_in_order():
    pool = make(dram_blocks=1, ssd_blocks=1)
    put(pool, [1])
    spill_all(pool, put(pool, [2]).plan)
    assert pool.drain_events() == [("stored", 1, "dram"), ("removed", 1, "dram"), ("stored", 2, "dram"),
                                   ("stored", 1, "ssd")]
    assert pool.drain_events() == []
    pool.remove([1, 2])
    assert pool.drain_events() == [("removed", 1, "ssd"), ("removed", 2, "dram")]


def test_restore_ssd_respects_capacity():
    pool = make(dram_blocks=1, ssd_blocks=1)
    assert pool.restore_ssd(1, 5, 0.0) and not pool.restore_ssd(2, 6, 0.0)
    assert pool.lookup([1]) == [Tier.SSD]
    assert pool.read(1, 0.0).checksum == 5


def test_checksum_is_xxh3_64():
    import xxhash

    assert checksum(b"abc") == xxhash.xxh3_64_intdigest(b"abc")


def test_invariants_under_random_operations_from_threads():
    """Slots are never shared, pinned blocks never leave DRAM, usage adds up."""
    pool = make(dram_blocks=8, ssd_blocks=8)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        pinned = []
        try:
            for step in range(2000):
                key = rng.randrange(40)
                op = rng.random()
                if op < 0.4:
                    reservation = pool.reserve([key], step)
                    spill_all(pool, reservation.plan, ok=rng.random() < 0.9)
                    if reservation.slots:
                        if rng.random() < 0.1:
                            pool.abort([key])
                        else:
                            pool.commit([key], [key], step)
                elif op < 0.7:
                    plan = pool.read(key, step)
                    if plan is not None:
                        spill_all(pool, plan.plan)
                        ok = not plan.load_from_ssd or rng.random() < 0.95
                        if plan.load_from_ssd:
                            pool.loaded(key, ok, step)
                        if ok:
                            pinned.append(key)
                elif pinned:
                    pool.unpin([pinned.pop(rng.randrange(len(pinned)))])
                for k in pinned:  # what this thread holds pinned is still in DRAM
                    assert pool.pins(k) > 0 and pool.lookup([k]) == [Tier.DRAM], k
            pool.unpin(pinned)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    slots = [e.slot for e in pool._dram.values()]
    assert len(slots) == len(set(slots))
    assert sorted(slots + pool._free_slots) == list(range(8))
    assert all(e.pins == 0 for e in pool._dram.values())
    assert len(pool._ssd) <= 8


def test_the_end_of_an_earlier_spill_of_a_key_does_not_mark_its_later_spill_written():
    # K is spilled, removed, and spilled again while the first write is still queued: the first
    # write's end used to mark the second entry ready (its file not written yet, and deleted next),
    # and the second write's failure was then ignored, leaving an SSD entry with no file.
    pool = make(dram_blocks=1, ssd_blocks=8)
    k = 7
    put(pool, [k])
    first = put(pool, [8]).plan.spills  # evicts K: spill #1
    assert [s.key for s in first] == [k]
    assert pool.remove([k]).ssd_deletes == [k]
    second = put(pool, [k]).plan.spills + put(pool, [9]).plan.spills  # K back, and evicted again: spill #2
    (spill2,) = [s for s in second if s.key == k]
    assert spill2.seq != first[0].seq
    pool.ssd_written(k, True, first[0].seq)  # the writer ends spill #1
    assert pool.lookup([k]) == [Tier.SSD] and not pool._ssd[k].ready  # still waiting for its own write
    assert pool.ssd_written(k, False, spill2.seq).ssd_deletes == [k]  # spill #2 failed: gone
    assert pool.lookup([k]) == []


def test_a_full_disk_shrinks_the_tier_to_what_it_holds_written_or_on_its_way():
    """Counting only the files already written shrank the tier below what the spills still queued
    would hold, and each later ENOSPC ratcheted it further down (to 1, with 12 blocks held)."""
    pool = make(dram_blocks=2, ssd_blocks=8)
    spills = [s for k in range(1, 7) for s in put(pool, [k]).plan.spills]  # keys 1-4 go to disk
    assert [s.key for s in spills] == [1, 2, 3, 4]
    pool.ssd_written(1, True)
    pool.ssd_written(2, True)
    pool.ssd_written(3, False)  # ENOSPC: gone from the tier; 4 is still on its way
    assert pool.shrink_ssd() == (8, 3)
    assert pool.usage()[Tier.SSD.value]["capacity_bytes"] == 3 * BB
