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
