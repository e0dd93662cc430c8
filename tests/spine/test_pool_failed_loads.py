"""Pool saves never commit KV computed over a block that failed to load: in the step it failed,
in the steps planned before vLLM heard of it, for every request sharing the block, and when a
flush leaves saves copying blocks vLLM reuses (kv_connector/pool_copier.py). Helpers and the
pool service fixture are test_pool_connector's."""

from __future__ import annotations

import threading
import time

import pytest

from kv_connector.pool_copier import POISON_STEPS, PoolCopier
from kv_connector.pool_planner import PoolPlanner
from mooncake.hashing import hash_prompt_blocks
from store.channel import PoolClient
from tests.spine.test_pool_connector import (BS, FakeManager, FakeRequest, blocks_of, caches, connect,  # noqa: F401
                                             plan_saves, save_prompt, save_step, service, step)


def test_blocks_computed_in_a_step_whose_pool_load_failed_are_not_saved(service):
    """Blocks 0-1 come from the pool, 2-3 are computed in the same step, over them. Block 1 is
    gone by the time it is read: vLLM recomputes from it, and blocks 2-3, computed over the bad
    KV, must not be committed under this prefix (every later hit would read them)."""
    tokens = list(range(70, 70 + 4 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    writer, _ = save_prompt(service, tokens[:2 * BS + 1], [0, 1, 2])
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    planner.bind_kv_cache_manager(FakeManager({"b": [8, 9, 10, 11, 12]}))
    req = FakeRequest("b", tokens)
    assert planner.matched_tokens(req, 0) == (2 * BS, False)
    planner.after_alloc(req, blocks_of([8, 9, 10, 11, 12]), 2 * BS)
    loads, saves, _ = planner.plan(step(new={"b": 2 * BS}, scheduled={"b": 2 * BS + 1}))
    assert [s.block_ids for s in saves] == [(10, 11)]
    service.pool.remove([keys[1]])  # evicted before the step runs
    kv = caches(fill=3.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(kv)
    reader.start_loads(loads)
    for name in kv:  # vLLM's order: each layer waits for its load, computes, then saves
        reader.wait_for_layer(name)
        reader.save_layer(saves, name)
    assert reader.take_invalid_blocks() == {9}
    reader.flush(["b"])
    assert reader.finished_saving({"b"}) == {"b"}  # its blocks are still freed
    assert service.lookup(keys[2:4]) == []  # nothing computed over the bad block was stored
    for c in (writer, reader):
        c.shutdown()


def test_saves_not_copied_before_their_blocks_are_reused_do_not_commit(service, monkeypatch):
    """flush (a preempted request: its blocks go to others in this step) gives up after its
    timeout; the saves still queued would copy other requests' KV, so they abort."""
    tokens = list(range(80, 80 + 2 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    kv = caches()
    copier = PoolCopier(connect(service), BS, load_timeout_s=0.2)
    copier.register_kv_caches(kv)
    saves = plan_saves(service, tokens, [0, 1, 2])
    assert saves
    copy = copier._save_layer
    release = threading.Event()

    def slow_copy(*args, **kwargs):  # the save thread is behind (a busy machine)
        release.wait(5)
        return copy(*args, **kwargs)

    monkeypatch.setattr(copier, "_save_layer", slow_copy)
    save_step(copier, saves, kv)
    copier.flush(["a"])  # times out
    release.set()
    deadline = time.monotonic() + 5
    while copier.finished_saving({"a"}) != {"a"}:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert service.lookup(keys) == []
    copier.shutdown()


def _shared_prefix_step(service, prefix):
    """r1 loads blocks 0-1 of `prefix` from the pool into blocks 8, 9; r2, admitted in the same
    step, holds those blocks through vLLM's prefix cache (sync loads are cached at allocation)
    and computes two blocks of its own, 12 and 13, over them."""
    r1_tokens, r2_tokens = prefix + [1] * (BS + 1), prefix + [2] * (2 * BS + 1)
    writer, _ = save_prompt(service, prefix + [0], [0, 1, 2])  # the pool holds the prefix's 2 blocks
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    manager = FakeManager({"r1": [8, 9, 10], "r2": [8, 9, 12, 13, 14]})
    planner.bind_kv_cache_manager(manager)
    r1, r2 = FakeRequest("r1", r1_tokens), FakeRequest("r2", r2_tokens)
    assert planner.matched_tokens(r1, 0) == (2 * BS, False)
    planner.after_alloc(r1, blocks_of(manager.blocks["r1"]), 2 * BS)
    assert planner.matched_tokens(r2, 2 * BS) == (0, False)
    planner.after_alloc(r2, blocks_of(manager.blocks["r2"]), 0)
    return writer, planner, hash_prompt_blocks(r2_tokens, BS)


@pytest.mark.parametrize("evicted", ["before_the_plan", "after_the_plan"])
def test_a_failed_load_spoils_the_saves_of_every_request_sharing_the_block(service, evicted):
    """Before the plan, r2 (which lacks k1 in the pool) plans to save block 9 itself; after it,
    only its own blocks. Either way the failed block's stale bytes, or blocks computed over them,
    were committed: r1's saves alone were spoiled, and later hits on the prefix read wrong KV."""
    writer, planner, keys = _shared_prefix_step(service, list(range(70, 70 + 2 * BS)))
    if evicted == "before_the_plan":
        service.pool.remove([keys[1]])
    loads, saves, _ = planner.plan(step(new={"r1": 2 * BS, "r2": 2 * BS}, scheduled={"r1": BS + 1, "r2": 2 * BS + 1}))
    assert any(save.request_id == "r2" for save in saves)
    if evicted == "after_the_plan":
        service.pool.remove([keys[1]])
    kv = caches(fill=7.0)  # block 9 holds some earlier request's KV
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(kv)
    reader.start_loads(loads)
    for name in kv:  # vLLM's order per layer: wait for the load, compute, save
        reader.wait_for_layer(name)
        reader.save_layer(saves, name)
    assert reader.take_invalid_blocks() == {9}  # vLLM recomputes block 9 (for both requests)
    reader.flush(["r1", "r2"])
    # The prefix's first block only: nothing of block 9 or computed over it.
    assert [service.lookup([key]) for key in keys] == [["dram"], [], [], []]
    for copier in (writer, reader):
        copier.shutdown()


def test_saves_of_the_steps_planned_before_a_failed_load_was_reported_do_not_commit(service):
    """Async scheduling (vLLM's default on GPU) plans step N+1, with the next chunk's saves,
    before step N's invalid blocks come back: that chunk is computed over the failed block."""
    tokens = list(range(70, 70 + 8 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    writer, _ = save_prompt(service, tokens[:2 * BS + 1], [0, 1, 2])  # the pool holds blocks 0-1
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    ids = [8, 9, 10, 11, 12, 13, 14, 15, 16]
    planner.bind_kv_cache_manager(FakeManager({"b": ids}))
    request = FakeRequest("b", tokens)
    assert planner.matched_tokens(request, 0) == (2 * BS, False)
    planner.after_alloc(request, blocks_of(ids), 2 * BS)
    steps = [planner.plan(step(new={"b": 2 * BS}, scheduled={"b": 2 * BS}))[:2]]  # N: chunk of 2 blocks
    steps.append(planner.plan(step(running={"b": 4 * BS}, scheduled={"b": 2 * BS}))[:2])  # N+1, planned early
    service.pool.remove([keys[1]])  # evicted before the worker reads it
    kv = caches(fill=3.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(kv)

    def run(loads, saves):
        reader.start_loads(loads)
        for name in kv:
            reader.wait_for_layer(name)
            reader.save_layer(saves, name)

    for loads, saves in steps:
        run(loads, saves)
    assert reader.take_invalid_blocks() == {9}
    reader.flush(["b"])
    assert [service.lookup([key]) for key in keys[2:6]] == [[], [], [], []]
    # Once vLLM has recomputed (steps later), saves over a reused block 9 commit again.
    for _ in range(POISON_STEPS):
        run([], [])
    planner.finished(request)
    again = FakeRequest("c", list(range(5000, 5000 + 2 * BS + 1)))
    planner.bind_kv_cache_manager(FakeManager({"c": [9, 2, 3]}))
    assert planner.matched_tokens(again, 0) == (0, False)
    planner.after_alloc(again, blocks_of([9, 2, 3]), 0)
    run(*planner.plan(step(new={"c": 0}, scheduled={"c": 2 * BS + 1}))[:2])
    reader.flush(["c"])
    assert service.lookup(hash_prompt_blocks(again.all_token_ids, BS)) == ["dram", "dram"]
    for copier in (writer, reader):
        copier.shutdown()
