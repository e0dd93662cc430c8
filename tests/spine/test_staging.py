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


def test_reserving_again_returns_the_same_slot():
    staging = KVStaging()
    a = staging.reserve("t", 2, 0, 4, 64, now=0.0)
    assert staging.reserve("t", 2, 0, 4, 64, now=0.1) is a


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
