from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.index import EventKind, KVEvent, PendingPrefixes, PrefixIndex

INSTANCES = [f"i{k}" for k in range(5)]
events = st.lists(st.tuples(st.sampled_from(list(EventKind)), st.sampled_from(INSTANCES),
                            st.lists(st.integers(0, 12), max_size=6)), max_size=60)


def reference_match(held: dict[str, set[int]], keys: list[int]) -> dict[str, int]:
    out = {}
    for inst, blocks in held.items():
        n = 0
        while n < len(keys) and keys[n] in blocks:
            n += 1
        if n:
            out[inst] = n
    return out


@settings(max_examples=300)
@given(events, st.lists(st.integers(0, 12), max_size=8), st.sets(st.sampled_from(INSTANCES), max_size=2))
def test_index_matches_a_set_model_under_random_events(evs, keys, dead):
    idx, held = PrefixIndex(), {i: set() for i in INSTANCES}
    for kind, inst, blocks in evs:
        idx.apply(KVEvent(kind, inst, tuple(blocks)))
        (held[inst].update if kind is EventKind.STORED else held[inst].difference_update)(blocks)
    for inst in dead:
        idx.remove_instance(inst)
        held[inst] = set()
    assert idx.match(keys) == reference_match(held, keys)
    for inst in INSTANCES:
        assert idx.block_count(inst) == len(held[inst])
    assert len(idx) == len(set().union(*held.values()))
    for k in range(13):
        assert idx.holders(k) == frozenset(i for i in INSTANCES if k in held[i])


def test_slots_are_reused_after_an_instance_dies():
    idx = PrefixIndex()
    idx.apply_stored("a", [1, 2])
    idx.remove_instance("a")
    idx.apply_stored("b", [1])
    assert idx.match([1, 2]) == {"b": 1}
    assert not idx.holds("a", 1) and idx.holds("b", 1)


def test_match_stops_at_first_missing_block():
    idx = PrefixIndex()
    idx.apply_stored("a", [1, 2, 3, 5])
    idx.apply_stored("b", [1, 2])
    idx.apply_stored("c", [2, 3])  # holds later blocks but not the first: no prefix
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 3, "b": 2}
    assert idx.match([]) == {}


@settings(max_examples=200)
@given(events, st.lists(st.integers(0, 12), max_size=12))
def test_match_is_the_same_across_chunk_boundaries(evs, keys):
    import conductor.core.index as index_mod

    idx, held = PrefixIndex(), {i: set() for i in INSTANCES}
    for kind, inst, blocks in evs:
        idx.apply(KVEvent(kind, inst, tuple(blocks)))
        (held[inst].update if kind is EventKind.STORED else held[inst].difference_update)(blocks)
    saved = index_mod._CHUNK
    try:
        for chunk in (1, 2, 3):
            index_mod._CHUNK = chunk
            assert idx.match(keys) == reference_match(held, keys)
    finally:
        index_mod._CHUNK = saved


pending_ops = st.lists(st.tuples(st.booleans(), st.sampled_from(INSTANCES[:3]), st.lists(st.integers(0, 6), max_size=5)),
                       max_size=40)


@settings(max_examples=300)
@given(pending_ops, st.lists(st.integers(0, 6), max_size=7))
def test_pending_prefixes_count_each_dispatch_until_its_prefill_ends(ops, keys):
    # Model: a multiset of blocks per instance; a block stays pending while any add() of it is
    # not yet undone by a discard(). Discarding what was never added changes nothing.
    pend, counts = PendingPrefixes(), {i: {} for i in INSTANCES[:3]}
    for is_add, inst, blocks in ops:
        c = counts[inst]
        if is_add:
            pend.add(inst, blocks)
            for b in blocks:
                c[b] = c.get(b, 0) + 1
        else:
            pend.discard(inst, blocks)
            for b in blocks:
                if c.get(b):
                    c[b] -= 1
    held = {i: {b for b, n in c.items() if n} for i, c in counts.items()}
    assert pend.match(keys) == reference_match(held, keys)
    assert len(pend) == sum(len(h) for h in held.values())


def test_pending_block_stays_until_every_prefill_that_computes_it_ends():
    pend = PendingPrefixes()
    pend.add("p0", [1, 2, 3])
    pend.add("p0", [1, 2])  # a second queued prompt sharing the first two blocks
    pend.discard("p0", [1, 2, 3])  # the first one ends
    assert pend.match([1, 2, 3]) == {"p0": 2}
    pend.discard("p0", [1, 2])
    assert pend.match([1, 2, 3]) == {} and len(pend) == 0


def test_pool_only_blocks_carry_their_tier_until_the_engine_holds_them_again():
    index = PrefixIndex()
    index.apply_stored("a", [1, 2, 3, 4])  # in a's engine
    index.apply_stored("a", [3, 4], pool_tiers={3: "dram", 4: "ssd"})  # evicted from it: pool only
    index.apply_stored("b", [1, 2], pool_tiers={1: "ssd"})
    assert index.match([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert index.block_count("a") == 4  # a tier change is not a new block
    assert index.pool_only_blocks("a", [1, 2, 3, 4], 4) == {"dram": 1, "ssd": 1}
    assert index.pool_only_blocks("a", [1, 2, 3, 4], 3) == {"dram": 1}
    assert index.pool_only_blocks("b", [1, 2, 3, 4], 2) == {"ssd": 1}
    index.apply_stored("a", [3])  # loaded back into the engine
    assert index.pool_only_blocks("a", [1, 2, 3, 4], 4) == {"ssd": 1}
    index.apply_removed("a", [4])
    assert index.pool_only_blocks("a", [1, 2, 3, 4], 4) == {}
    index.remove_instance("b")
    index.apply_stored("b", [1])  # a new instance in b's slot starts with its engine
    assert index.pool_only_blocks("b", [1], 1) == {}
