"""The decode side's staging arena (decode/staging.py): reservations, landing, failure, expiry."""

import pytest

from decode.staging import ALIGN, Arena, KVStaging, StagingConfig, StagingFull


def test_transfer_completes_when_every_block_of_every_layer_landed():
    staging = KVStaging()
    entry = staging.reserve("t", num_layers=2, first_block=1, num_blocks=3, block_bytes=100, now=0.0)
    assert entry.block_offset(1, 2) == entry.offset + (1 * 3 + 1) * 100
    staging.landed("t", 0, 1, 4)
    staging.landed("t", 1, 1, 2)  # a first chunk of layer 1
    assert not staging.peek("t").complete
    staging.landed("t", 1, 2, 4)  # the rest, in a later chunk
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
    staging.landed("t", 0, 4, 6, slot=first_slot)
    staging.landed("t", 1, 4, 6, slot=first_slot)
    again = staging.reserve("t", 2, first_block=0, num_blocks=8, block_bytes=ALIGN, now=1.0)
    assert again is not first and again.offset not in (first_slot, other.offset)
    assert (again.first_block, again.num_blocks, again.landed) == (0, 8, [0, 0])
    end = again.offset + again.nbytes
    assert end <= other.offset or again.offset >= other.offset + other.nbytes  # fits its own slot
    with pytest.raises(KeyError):  # the first producer, resumed: its note is for the old slot
        staging.landed("t", 0, 6, 8, slot=first_slot)
    staging.fail("t", "the first producer's link died", now=1.5, slot=first_slot)
    assert staging.peek("t").error is None  # nor does its failure spoil the new attempt
    assert staging.used_bytes == 2 * 2 * 4 * ALIGN + 2 * 8 * ALIGN  # the old slot held back (quarantine)
    staging.expire(now=11.5)
    assert staging.used_bytes == 2 * 4 * ALIGN + 2 * 8 * ALIGN


def test_a_block_that_lands_twice_counts_once():
    staging = KVStaging()
    entry = staging.reserve("t", 1, 0, 4, 64, now=0.0)
    staging.landed("t", 0, 0, 2, slot=entry.offset)
    staging.landed("t", 0, 0, 2, slot=entry.offset)  # the same chunk again: blocks [2, 4) never came
    assert not staging.peek("t").complete and entry.landed == [2]
    staging.landed("t", 0, 1, 4)
    assert staging.peek("t").complete


def test_capacity_refuses_instead_of_growing():
    staging = KVStaging(StagingConfig(capacity_bytes=4 * ALIGN))
    staging.reserve("a", 1, 0, 3, ALIGN, now=0.0)
    with pytest.raises(StagingFull):
        staging.reserve("b", 1, 0, 2, ALIGN, now=0.0)
    staging.landed("a", 0, 0, 3)
    staging.pop("a", now=0.0)  # complete: its slot is free again at once
    staging.reserve("b", 1, 0, 4, ALIGN, now=0.0)


def test_an_incomplete_transfers_slot_is_held_back_from_late_writes():
    staging = KVStaging(StagingConfig(capacity_bytes=2 * ALIGN, ttl_s=10.0))
    staging.reserve("a", 1, 0, 2, ALIGN, now=0.0)
    staging.landed("a", 0, 0, 1)
    staging.pop("a", now=1.0)  # the load failed or timed out; the prefill may still write
    with pytest.raises(StagingFull):
        staging.reserve("b", 1, 0, 1, ALIGN, now=2.0)
    staging.expire(now=12.0)
    staging.reserve("b", 1, 0, 2, ALIGN, now=12.0)


def test_unclaimed_transfers_expire_after_ttl():
    staging = KVStaging(StagingConfig(ttl_s=1.0))
    staging.reserve("t", 1, 0, 1, 8, now=0.0)
    assert staging.expire(now=0.5) == []
    assert staging.expire(now=1.5) == ["t"]
    assert staging.peek("t") is None


def test_failed_transfer_is_never_complete():
    staging = KVStaging()
    staging.reserve("t", 1, 0, 1, 8, now=0.0)
    staging.landed("t", 0, 0, 1)
    staging.fail("t", "checksum mismatch", now=0.1)
    assert not staging.peek("t").complete and staging.peek("t").error == "checksum mismatch"
    staging.fail("never-reserved", "peer died", now=0.1)
    assert staging.peek("never-reserved").error == "peer died"


def test_notes_outside_the_reservation_are_errors():
    staging = KVStaging()
    staging.reserve("t", 2, 2, 2, 8, now=0.0)
    for layer, a, b in ((2, 2, 3), (0, 1, 3), (0, 3, 5)):
        with pytest.raises(ValueError):
            staging.landed("t", layer, a, b)
    with pytest.raises(KeyError):
        staging.landed("other", 0, 2, 3)


def test_arena_coalesces_freed_neighbours():
    arena = Arena(8 * ALIGN)
    a, b, c = arena.alloc(ALIGN), arena.alloc(2 * ALIGN), arena.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    arena.free(a, ALIGN)
    arena.free(c, ALIGN)
    arena.free(b, 2 * ALIGN)
    assert arena.used == 0 and arena.alloc(8 * ALIGN) == 0
