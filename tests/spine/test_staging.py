"""The decode side's staging arena (decode/staging.py): reservations, landing, failure, expiry."""

import pytest

from decode.staging import ALIGN, Arena, KVStaging, StagingConfig, StagingFull


def test_transfer_completes_when_every_block_of_every_layer_landed():
    staging = KVStaging()
    entry = staging.reserve("t", num_layers=2, first_block=1, num_blocks=3, block_bytes=100, now=0.0)
    assert entry.block_offset(1, 2) == entry.offset + (1 * 3 + 1) * 100
    staging.landed("t", 0, 1, 4, now=0.0)
    staging.landed("t", 1, 1, 2, now=0.0)  # a first chunk of layer 1
    assert not staging.peek("t").complete
    staging.landed("t", 1, 2, 4, now=0.0)  # the rest, in a later chunk
    assert staging.peek("t").complete
    assert staging.used_bytes == ALIGN
    staging.pop("t", now=0.1)
    assert staging.used_bytes == 0


def test_a_transfer_reserved_again_starts_over_in_a_fresh_slot_of_its_own_shape():
    """A retried prefill (another instance, the same request id) may skip other blocks than the
    first attempt: its writes must fit its own slot, and the first producer's late bytes and
    notes must not count for it."""
    staging = KVStaging(StagingConfig(capacity_bytes=64 * ALIGN, ttl_s=10.0))
    first = staging.reserve("t", 2, first_block=4, num_blocks=4, block_bytes=ALIGN, now=0.0)
    first_slot = first.offset  # the slot the first producer writes to (a released entry forgets it)
    other = staging.reserve("u", 2, first_block=0, num_blocks=4, block_bytes=ALIGN, now=0.0)
    staging.landed("t", 0, 4, 6, now=0.5, slot=first_slot)
    staging.landed("t", 1, 4, 6, now=0.5, slot=first_slot)
    again = staging.reserve("t", 2, first_block=0, num_blocks=8, block_bytes=ALIGN, now=1.0)
    assert again is not first and again.offset not in (first_slot, other.offset)
    assert (again.first_block, again.num_blocks, again.landed) == (0, 8, [0, 0])
    end = again.offset + again.nbytes
    assert end <= other.offset or again.offset >= other.offset + other.nbytes  # fits its own slot
    with pytest.raises(KeyError):  # the first producer, resumed: its note is for the old slot
        staging.landed("t", 0, 6, 8, now=1.5, slot=first_slot)
    staging.fail("t", "the first producer's link died", now=1.5, slot=first_slot)
    assert staging.peek("t").error is None  # nor does its failure spoil the new attempt
    assert staging.used_bytes == 2 * 2 * 4 * ALIGN + 2 * 8 * ALIGN  # the old slot held back (quarantine)
    staging.expire(now=11.5)
    assert staging.used_bytes == 2 * 4 * ALIGN + 2 * 8 * ALIGN


def test_a_block_that_lands_twice_counts_once():
    staging = KVStaging()
    entry = staging.reserve("t", 1, 0, 4, 64, now=0.0)
    staging.landed("t", 0, 0, 2, now=0.0, slot=entry.offset)
    staging.landed("t", 0, 0, 2, now=0.0, slot=entry.offset)  # the same chunk again: blocks [2, 4) never came
    assert not staging.peek("t").complete and entry.landed == [2]
    staging.landed("t", 0, 1, 4, now=0.0)
    assert staging.peek("t").complete


def test_capacity_refuses_instead_of_growing():
    staging = KVStaging(StagingConfig(capacity_bytes=4 * ALIGN))
    staging.reserve("a", 1, 0, 3, ALIGN, now=0.0)
    with pytest.raises(StagingFull):
        staging.reserve("b", 1, 0, 2, ALIGN, now=0.0)
    staging.landed("a", 0, 0, 3, now=0.0)
    staging.pop("a", now=0.0)  # complete: its slot is free again at once
    staging.reserve("b", 1, 0, 4, ALIGN, now=0.0)


def test_an_incomplete_transfers_slot_is_held_back_from_late_writes():
    staging = KVStaging(StagingConfig(capacity_bytes=2 * ALIGN, ttl_s=10.0))
    staging.reserve("a", 1, 0, 2, ALIGN, now=0.0)
    staging.landed("a", 0, 0, 1, now=0.0)
    staging.pop("a", now=1.0)  # the load failed or timed out; the prefill may still write
    with pytest.raises(StagingFull):
        staging.reserve("b", 1, 0, 1, ALIGN, now=2.0)
    staging.expire(now=12.0)
    staging.reserve("b", 1, 0, 2, ALIGN, now=12.0)


def test_unclaimed_transfers_expire_after_ttl_into_a_tombstone_that_fails_a_later_pull():
    """The prefill's notes for it are acknowledged by the engine all the same: the decode's pull
    must learn it is gone at once, not after its wait timeout."""
    staging = KVStaging(StagingConfig(ttl_s=1.0))
    entry = staging.reserve("t", 1, 0, 2, 8, now=0.0)
    assert staging.expire(now=0.5) == []
    assert staging.expire(now=1.5) == ["t"]
    with pytest.raises(KeyError):  # a late note of it counts for nothing
        staging.landed("t", 0, 0, 2, now=1.6, slot=entry.offset)
    tombstone = staging.claim("t")
    assert tombstone is not None and "TTL" in tombstone.error and tombstone.offset == -1
    staging.fail("u", "peer died", now=1.5)
    staging.reserve("v", 1, 0, 1, 8, now=1.5)
    assert staging.expire(now=3.0) == ["v"]  # "u" held no slot: simply forgotten
    assert staging.peek("u") is None and staging.peek("v").error is not None
    assert staging.expire(now=4.5) == [] and staging.peek("v") is None  # a tombstone lasts one TTL


def test_the_ttl_counts_from_the_last_landed_layer_not_the_reservation():
    """A long push (a long prompt, a slow prefill) is alive as long as its layers keep landing."""
    staging = KVStaging(StagingConfig(ttl_s=1.0))
    staging.reserve("t", 2, 0, 1, 8, now=0.0)
    staging.landed("t", 0, 0, 1, now=0.9)
    assert staging.expire(now=1.5) == []
    staging.landed("t", 1, 0, 1, now=1.8)
    assert staging.claim("t").complete


def test_a_claimed_transfer_keeps_its_slot_through_a_drop_and_a_new_reservation():
    """The consumer copies out of a claimed slot outside the lock: the control thread's drop, or
    a new producer's reservation of the same id, must not free it (nor hand it out) meanwhile."""
    staging = KVStaging(StagingConfig(capacity_bytes=4 * ALIGN, ttl_s=10.0))
    staging.reserve("t", 1, 0, 2, ALIGN, now=0.0)
    assert staging.claim("t") is None and staging.peek("t") is not None  # still arriving: stays
    staging.landed("t", 0, 0, 2, now=0.0)
    claimed = staging.claim("t")
    offset = claimed.offset
    assert staging.pop("t", now=0.1) is None and claimed.offset == offset  # the drop finds nothing
    again = staging.reserve("t", 1, 0, 2, ALIGN, now=0.1)
    assert again.offset >= offset + 2 * ALIGN or again.offset + 2 * ALIGN <= offset  # not the claimed slot
    with pytest.raises(StagingFull):
        staging.reserve("u", 1, 0, 1, ALIGN, now=0.1)
    staging.release(claimed, now=0.2)  # landed: complete, so free at once
    assert staging.used_bytes == 2 * ALIGN and staging.peek("t") is again


def test_failed_transfer_is_never_complete():
    staging = KVStaging()
    staging.reserve("t", 1, 0, 1, 8, now=0.0)
    staging.landed("t", 0, 0, 1, now=0.0)
    staging.fail("t", "checksum mismatch", now=0.1)
    assert not staging.peek("t").complete and staging.peek("t").error == "checksum mismatch"
    staging.fail("never-reserved", "peer died", now=0.1)
    assert staging.peek("never-reserved").error == "peer died"


def test_notes_outside_the_reservation_are_errors():
    staging = KVStaging()
    staging.reserve("t", 2, 2, 2, 8, now=0.0)
    for layer, a, b in ((2, 2, 3), (0, 1, 3), (0, 3, 5)):
        with pytest.raises(ValueError):
            staging.landed("t", layer, a, b, now=0.0)
    with pytest.raises(KeyError):
        staging.landed("other", 0, 2, 3, now=0.0)


def test_arena_coalesces_freed_neighbours():
    arena = Arena(8 * ALIGN)
    a, b, c = arena.alloc(ALIGN), arena.alloc(2 * ALIGN), arena.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    arena.free(a, ALIGN)
    arena.free(c, ALIGN)
    arena.free(b, 2 * ALIGN)
    assert arena.used == 0 and arena.alloc(8 * ALIGN) == 0
