"""The producer's plan (prefill/push_planner.py): what each step of a chunked prompt pushes.

vLLM's scheduler objects are replaced by the few fields the planner reads (a unit test of one
piece; the real scheduler drives it in tests/e2e/test_kv_path.py)."""

from types import SimpleNamespace

from mooncake.protocol import PushParams
from prefill.push_planner import PushPlanner

BLOCK = 4


class Blocks:
    def __init__(self, table):
        self.table = table

    def get_block_ids(self, req_id):
        return (self.table[req_id],)


def request(req_id, num_tokens, skip=0):
    params = PushParams(transfer_id="t-" + req_id, dest="d:1", num_tokens=num_tokens, skip_blocks=skip)
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params.to_params())


def step(planner, new=(), cached=(), scheduled=None):
    """new / cached: (req_id, num_computed_tokens) scheduled this step; scheduled: tokens each."""
    out = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled or {})
    return planner.plan(out)


def planner_with(table, *requests):
    planner = PushPlanner(BLOCK)
    planner.bind_kv_cache_manager(Blocks(table))
    for r in requests:
        planner.after_alloc(r)
    return planner


def test_every_chunk_pushes_the_blocks_it_completed_and_the_last_one_the_rest():
    # 18 tokens = 5 blocks (the last holds 2); chunks of 7, 7, 4 tokens.
    planner = planner_with({"a": [10, 11, 12, 13, 14]}, request("a", 18))
    first = step(planner, new=[("a", 0)], scheduled={"a": 7})
    assert [(s.first_block, s.block_ids, s.final) for s in first] == [(0, (10,), False)]  # block 1 is half done
    second = step(planner, cached=[("a", 7)], scheduled={"a": 7})
    assert [(s.first_block, s.block_ids, s.final) for s in second] == [(1, (11, 12), False)]
    last = step(planner, cached=[("a", 14)], scheduled={"a": 4})
    assert [(s.first_block, s.block_ids, s.final) for s in last] == [(3, (13, 14), True)]
    assert last[0].total_blocks == 5 and last[0].transfer_id == "t-a"
    assert step(planner, cached=[("a", 18)], scheduled={"a": 1}) == []  # decoding: nothing more
    assert planner.finished("a") is True  # its sends hold the blocks (delayed free)
    assert planner.finished("a") is False


def test_a_chunk_that_completes_no_block_pushes_nothing():
    planner = planner_with({"a": [1, 2, 3]}, request("a", 12))
    assert step(planner, new=[("a", 0)], scheduled={"a": 3}) == []
    assert [s.block_ids for s in step(planner, cached=[("a", 3)], scheduled={"a": 9})] == [(1, 2, 3)]


def test_blocks_the_decode_worker_holds_are_not_pushed():
    planner = planner_with({"a": [7, 8, 9, 6]}, request("a", 14, skip=2))
    specs = step(planner, new=[("a", 0)], scheduled={"a": 14})
    assert [(s.first_block, s.block_ids, s.skip_blocks) for s in specs] == [(2, (9, 6), 2)]


def test_the_prefills_own_prefix_hit_is_pushed_with_its_first_step():
    planner = planner_with({"a": [7, 8, 9]}, request("a", 10))
    specs = step(planner, new=[("a", 8)], scheduled={"a": 2})  # blocks 0-1 were in P's cache
    assert [(s.first_block, s.block_ids, s.final) for s in specs] == [(0, (7, 8, 9), True)]


def test_a_final_step_with_every_block_skipped_still_closes_the_transfer():
    planner = planner_with({"a": [1, 2]}, request("a", 8, skip=2))
    specs = step(planner, new=[("a", 0)], scheduled={"a": 8})
    assert [(s.block_ids, s.final) for s in specs] == [((), True)]


def test_requests_without_a_push_are_not_delayed():
    planner = planner_with({"b": [1]})
    planner.after_alloc(SimpleNamespace(request_id="b", kv_transfer_params={}))
    assert step(planner, new=[("b", 0)], scheduled={"b": 4}) == []
    assert planner.finished("b") is False


def test_a_request_aborted_before_any_push_frees_at_once():
    planner = planner_with({"a": [1, 2]}, request("a", 8))
    assert planner.finished("a") is False
    assert step(planner, new=[("a", 0)], scheduled={"a": 8}) == []


def test_preempted_requests_with_sends_are_named_for_the_worker():
    planner = planner_with({"a": [1, 2, 3], "b": [4]}, request("a", 12), request("b", 4))
    step(planner, new=[("a", 0)], scheduled={"a": 8})  # a sent two blocks; b was never scheduled
    assert planner.preempted({"a", "b", "c"}) == {"a"} and planner.preempted(None) == set()
    # Rescheduled after the preemption (recomputed from 0): blocks already sent do not go again.
    planner.after_alloc(request("a", 12))
    assert [(s.first_block, s.final) for s in step(planner, cached=[("a", 0)], scheduled={"a": 12})] == [(2, True)]


def test_pushes_that_carried_kv_computed_over_a_block_that_failed_to_load_are_named():
    """A pool hit loaded in the step (blocks 0-1 of each prompt) failed for one block: vLLM
    recomputes from it, but blocks computed over it already went (in the final step too). Only
    pushes with planned blocks from the first bad one on carry wrong KV."""
    table = {"a": [7, 8, 9], "b": [1, 2, 3, 4, 5], "c": [20, 21, 22]}
    planner = planner_with(table, request("a", 10), request("b", 20), request("c", 10, skip=2))
    step(planner, new=[("a", 8), ("b", 8), ("c", 8)], scheduled={"a": 2, "b": 4, "c": 2})
    # a: all 3 blocks went (final); b: blocks 0-2 went, 3-4 not yet; c: blocks 0-1 skipped, 2 went.
    assert planner.invalid_blocks(set()) == []
    assert planner.invalid_blocks({8}) == [("a", "t-a")]
    assert planner.invalid_blocks({4}) == []  # b's block 3: not planned yet, vLLM recomputes it before it goes
    assert planner.invalid_blocks({3}) == [("b", "t-b")]
    assert planner.invalid_blocks({21}) == [("c", "t-c")]  # skipped itself, but block 2 was computed over it
    planner.finished("a")
    assert planner.invalid_blocks({8}) == []


def test_a_push_of_a_request_preempted_before_the_failure_is_reported_is_named_too():
    """Async scheduling plans the next step, which may preempt the request (its block table then
    empty), before this step's failed loads reach the scheduler: the push went over them all the
    same, and was not failed (the decode side took KV computed over the bad block)."""
    table = {"a": [7, 8, 9]}
    planner = planner_with(table, request("a", 10))
    step(planner, new=[("a", 8)], scheduled={"a": 2})
    table["a"] = []  # preempted: its blocks went back
    assert planner.invalid_blocks({8}) == [("a", "t-a")]


def test_the_connector_carries_invalidated_pushes_from_the_scheduler_to_the_worker():
    """The glue in kv_connector/connector.py: vLLM's update_connector_output (invalid blocks of
    the last step) -> the next step's metadata -> the worker's sender, before the forward."""
    from vllm.v1.outputs import KVConnectorOutput

    from decode.load_planner import LoadPlanner
    from kv_connector.connector import MooncakeServeConnector

    scheduler = object.__new__(MooncakeServeConnector)  # its scheduler half, without a VllmConfig
    scheduler._pushes, scheduler._loads, scheduler._invalidated = planner_with({"a": [7, 8, 9]}, request("a", 10)), \
        LoadPlanner(BLOCK), []
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=8)],
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                          num_scheduled_tokens={"a": 2}, preempted_req_ids=set())
    assert [s.final for s in scheduler.build_connector_meta(out).saves] == [True]
    scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={8}))
    out.scheduled_new_reqs, out.num_scheduled_tokens = [], {}
    meta = scheduler.build_connector_meta(out)
    assert meta.invalidated == [("a", "t-a")]
    assert scheduler.build_connector_meta(out).invalidated == []  # told once

    told = []
    worker = object.__new__(MooncakeServeConnector)
    worker._sender = SimpleNamespace(settle=lambda ids: None,
                                     invalidate=lambda req, transfer, why: told.append((req, transfer)))
    worker.handle_preemptions(meta)
    assert told == [("a", "t-a")]
