"""The pool connector's halves without an engine: the planner (vLLM's scheduler side) and the
copier (its worker side) against a real pool service (store/service.py, in this process, over
its real local channel), with small CPU tensors as the paged KV cache. vLLM's Request, block
manager and scheduler output are stand-ins carrying only the fields the connector reads."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from kv_connector.pool_copier import ArenaLayout, PoolCopier
from kv_connector.pool_planner import PoolPlanner
from mooncake.hashing import hash_prompt_blocks
from mooncake.protocol import CONSUMER_KEY
from store.channel import PoolClient
from store.config import PoolConfig
from store.pool import checksum
from store.service import PoolService

BS = 4  # tokens per block
LAYERS = 3
BLOCK_SHAPE = (2, BS, 2, 8)  # (k/v, tokens, heads, head dim) of one block of one layer
NUM_BLOCKS = 16


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: dict | None = None

    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class FakeManager:
    blocks: dict[str, list[int]] = field(default_factory=dict)

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],)


def blocks_of(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(new: dict[str, int] = None, running: dict[str, int] = None, scheduled: dict[str, int] = None,
         preempted=()):
    """A SchedulerOutput with what the planner reads: computed tokens before the step, scheduled."""
    new, running = new or {}, running or {}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new.items()],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(running), num_computed_tokens=list(running.values())),
        num_scheduled_tokens=scheduled or {}, preempted_req_ids=set(preempted))


@pytest.fixture
def service():
    layout_bytes = LAYERS * int(torch.zeros(BLOCK_SHAPE).numel() * 4)
    svc = PoolService(PoolConfig(dram_bytes=8 * layout_bytes, ssd_dir=None), remote=False).start()
    yield svc
    svc.close()


def caches(fill: float | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(LAYERS):
        t = torch.rand((NUM_BLOCKS, *BLOCK_SHAPE), generator=gen)
        out[f"model.layers.{i}.self_attn.attn"] = t if fill is None else torch.full_like(t, fill)
    return out


def connect(service):
    return lambda timeout_s: PoolClient(service.endpoint, timeout_s)


def save_step(copier: PoolCopier, saves, kv):
    for name in kv:
        copier.save_layer(saves, name)


def plan_saves(service, tokens, block_ids):
    """The saves a planner plans for request "a", whose `tokens` are all computed in one step
    into `block_ids` (nothing of them cached)."""
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    planner.bind_kv_cache_manager(FakeManager({"a": list(block_ids)}))
    req = FakeRequest("a", tokens)
    planner.matched_tokens(req, 0)
    planner.after_alloc(req, blocks_of(block_ids), 0)
    _, saves, _ = planner.plan(step(new={"a": 0}, scheduled={"a": len(tokens)}))
    return saves


def save_prompt(service, tokens, block_ids):
    """An engine (its planner and copier) computes `tokens` into `block_ids` and saves every full
    block to the pool. Returns (its copier, its KV cache)."""
    source = caches()
    writer = PoolCopier(connect(service), BS)
    writer.register_kv_caches(source)
    save_step(writer, plan_saves(service, tokens, block_ids), source)
    writer.flush(["a"])
    return writer, source


def test_layout_lays_layers_end_to_end():
    layout = ArenaLayout.of(caches())
    size = int(torch.zeros(BLOCK_SHAPE).numel() * 4)
    assert layout.offsets == (0, size, 2 * size) and layout.block_bytes == 3 * size


def test_saved_blocks_are_committed_then_loaded_layer_by_layer_into_another_engine(service):
    tokens = list(range(100, 100 + 3 * BS + 2))  # 3 full blocks and a partial one
    source = caches()
    writer = PoolCopier(connect(service), BS)
    writer.register_kv_caches(source)
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    manager = FakeManager({"a": [5, 9, 2, 7]})
    planner.bind_kv_cache_manager(manager)
    req = FakeRequest("a", tokens)
    assert planner.matched_tokens(req, 0) == (0, False)  # the pool is empty
    planner.after_alloc(req, blocks_of([5, 9, 2, 7]), 0)
    loads, saves, flush = planner.plan(step(new={"a": 0}, scheduled={"a": len(tokens)}))
    assert loads == [] and flush == ()
    assert [s.block_ids for s in saves] == [(5, 9, 2)]  # full blocks only
    save_step(writer, saves, source)
    assert planner.finished(req) == (True, 0)  # blocks kept until the copies are done...
    writer.flush(["a"])  # (both save stages done)
    assert writer.finished_saving({"a"}) == {"a"}  # ...which they are now
    keys = hash_prompt_blocks(tokens, BS)
    assert service.lookup(keys) == ["dram"] * 3

    # A second engine (fresh cache) gets the prefix from the pool, synchronously, layer by layer.
    target = caches(fill=0.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(target)
    planner2 = PoolPlanner(PoolClient(service.endpoint), BS)
    planner2.bind_kv_cache_manager(FakeManager({"b": [1, 3, 4, 6]}))
    req2 = FakeRequest("b", tokens[:3 * BS] + [7, 7, 7])
    assert planner2.matched_tokens(req2, 0) == (3 * BS, False)  # in DRAM: a synchronous load
    planner2.after_alloc(req2, blocks_of([1, 3, 4, 6]), 3 * BS)
    loads, saves, _ = planner2.plan(step(new={"b": 3 * BS}, scheduled={"b": 3}))
    assert [(l.block_ids, l.sync) for l in loads] == [((1, 3, 4), True)] and saves == []
    reader.start_loads(loads)
    for name in target:
        reader.wait_for_layer(name)
        assert torch.equal(target[name][[1, 3, 4]], source[name][[5, 9, 2]])
    assert reader.take_invalid_blocks() == set()
    reader._loader.submit(lambda: None).result()
    # Unpinned once copied. The release is sent without an answer (PoolClient.release), so the
    # service may apply it a moment after the loader sent it.
    deadline = time.monotonic() + 5.0
    while service.pool.pins(keys[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.pool.pins(keys[0]) == 0
    for c in (writer, reader):
        c.shutdown()


def test_a_pulled_prompt_is_left_to_the_serve_connector(service):
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    req = FakeRequest("d", list(range(20)), {CONSUMER_KEY: {"transfer_id": "t", "num_tokens": 20}})
    assert planner.matched_tokens(req, 0) == (0, False)


def test_the_prompts_last_token_is_always_computed(service):
    tokens = list(range(2 * BS))  # exactly two blocks
    service.configure(LAYERS * int(torch.zeros(BLOCK_SHAPE).numel() * 4), "x")
    keys = hash_prompt_blocks(tokens, BS)
    for key, slot in service.reserve(keys):
        service.commit([key])
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    assert planner.matched_tokens(FakeRequest("e", tokens), 0) == (BS, False)  # not both blocks


def test_a_block_evicted_before_the_worker_reads_it_is_reported_for_recompute(service):
    tokens = list(range(50, 50 + 2 * BS + 1))
    writer, source = save_prompt(service, tokens, [0, 1, 2])
    planner2 = PoolPlanner(PoolClient(service.endpoint), BS)
    planner2.bind_kv_cache_manager(FakeManager({"b": [8, 9, 10]}))
    req2 = FakeRequest("b", tokens)
    assert planner2.matched_tokens(req2, 0) == (2 * BS, False)
    planner2.after_alloc(req2, blocks_of([8, 9, 10]), 2 * BS)
    loads, _, _ = planner2.plan(step(new={"b": 2 * BS}, scheduled={"b": 1}))
    service.pool.remove([hash_prompt_blocks(tokens, BS)[1]])  # gone before the step runs
    target = caches(fill=0.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(target)
    reader.start_loads(loads)
    for name in target:
        reader.wait_for_layer(name)
    assert reader.take_invalid_blocks() == {9}  # vLLM recomputes from there
    assert torch.equal(target[next(iter(target))][8], source[next(iter(source))][0])
    for c in (writer, reader):
        c.shutdown()


def test_blocks_loaded_from_the_pool_are_never_saved_back(service):
    """A hit evicted between the lookup and the step fails its load, which leaves the engine's
    blocks holding another request's KV: saving them in the same step would store that KV under
    this prefix. Blocks before the hit (vLLM's own cache) are still saved."""
    tokens = list(range(50, 50 + 3 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    writer, source = save_prompt(service, tokens, [0, 1, 2, 3])
    good = {k: service.arena.slot(s).tobytes() for k, s, _ in service.read(keys[:3])}
    service.release(keys[:3])
    service.pool.remove([keys[0]])  # vLLM's cache holds block 0 here; the pool lost it

    planner2 = PoolPlanner(PoolClient(service.endpoint), BS)
    planner2.bind_kv_cache_manager(FakeManager({"b": [8, 9, 10, 11]}))
    req2 = FakeRequest("b", tokens)
    assert planner2.matched_tokens(req2, BS) == (2 * BS, False)  # blocks 1-2 from the pool
    service.pool.remove(keys[1:3])  # evicted before the step runs
    planner2.after_alloc(req2, blocks_of([8, 9, 10, 11]), 2 * BS)
    loads, saves, _ = planner2.plan(step(new={"b": 3 * BS}, scheduled={"b": 1}))
    assert [s.block_ids for s in saves] == [(8,)]  # vLLM's cached block 0, not the loaded 9 and 10
    stale = caches(fill=7.0)
    for name in stale:
        stale[name][8] = source[name][0]  # what vLLM's cache holds
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(stale)
    reader.start_loads(loads)
    for name in stale:
        reader.wait_for_layer(name)
    assert reader.take_invalid_blocks() == {9, 10}  # vLLM recomputes them
    save_step(reader, saves, stale)
    reader.flush(["b"])
    assert service.lookup(keys) == ["dram"]  # block 0 saved again; nothing stale stored
    got = service.read(keys[:1])
    assert service.arena.slot(got[0][1]).tobytes() == good[keys[0]]
    for c in (writer, reader):
        c.shutdown()


@pytest.mark.parametrize("sync", [True, False], ids=["dram", "promoted"])
def test_a_block_changed_in_dram_after_its_commit_is_caught_and_forgotten(service, sync):
    tokens = list(range(60, 60 + 2 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    writer, source = save_prompt(service, tokens, [0, 1, 2])
    (_, slot, _), = service.read(keys[1:2])
    service.release(keys[1:2])
    service.arena.slot(slot)[100] ^= 0xFF  # a stray write into a committed block

    from kv_connector.pool_planner import PoolLoad
    load = PoolLoad("b", tuple(keys[:2]), (8, 9), sync)
    target = caches(fill=0.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(target)
    reader.start_loads([load])
    if sync:
        for name in target:
            reader.wait_for_layer(name)
        assert reader.take_invalid_blocks() == {9}  # vLLM recomputes from there
    else:
        deadline = time.monotonic() + 10
        while not (done := reader.collect_loads())[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == ({"b"}, {"b"})  # the load fails: vLLM recomputes the prompt
    deadline = time.monotonic() + 5  # the discard is sent without an answer
    while service.lookup(keys) != ["dram"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.lookup(keys) == ["dram"]  # the changed block is forgotten, block 0 kept
    assert service.stats()["counters"]["corrupt_dram"] == 1
    for c in (writer, reader):
        c.shutdown()


def test_a_slot_written_between_a_saves_copy_and_its_commit_fails_its_reads(service):
    """A late write into a reserved slot (a peer's transfer answering past its quarantine) before
    the save commits: the commit carries the checksums of the bytes the save copied, so the block
    is caught when read; were the slot hashed at commit, the stray bytes would be served as KV."""
    from kv_connector.pool_planner import PoolLoad
    tokens = list(range(40, 40 + 2 * BS + 1))
    keys = hash_prompt_blocks(tokens, BS)
    source = caches()
    writer = PoolCopier(connect(service), BS)
    writer.register_kv_caches(source)
    saves = plan_saves(service, tokens, [0, 1, 2])
    *first, last = list(source)
    for name in first:
        writer.save_layer(saves, name)
    writer._saver.submit(lambda: None).result()  # those layers are in their slots
    service.arena.slot(saves[0].slots[1])[3] ^= 0xFF  # the stray write, into layer 0 of block 1
    writer.save_layer(saves, last)
    writer.flush(["a"])
    assert service.lookup(keys) == ["dram", "dram"]  # committed as usual...

    target = caches(fill=0.0)
    reader = PoolCopier(connect(service), BS)
    reader.register_kv_caches(target)
    reader.start_loads([PoolLoad("b", tuple(keys), (8, 9), True)])
    for name in target:
        reader.wait_for_layer(name)
    assert reader.take_invalid_blocks() == {9}  # ...but block 1 is recomputed, never used
    assert torch.equal(target[first[0]][8], source[first[0]][0])
    for c in (writer, reader):
        c.shutdown()


def test_a_save_whose_layers_come_out_of_order_leaves_the_checksums_to_the_pool():
    from kv_connector.pool_checksums import SaveJob
    rows = [b"ab", b"cd"]
    in_order, out_of_order = SaveJob(2, 2), SaveJob(2, 2)
    in_order.hash_layer(0, rows)
    in_order.hash_layer(1, rows)
    assert in_order.checksums() == [checksum(b"abab"), checksum(b"cdcd")]  # the slot's bytes, in order
    out_of_order.hash_layer(1, rows)
    out_of_order.hash_layer(0, rows)
    assert out_of_order.checksums() is None  # commit(keys) without checksums: the pool hashes the slots


def test_a_worker_without_the_arena_gives_its_saves_back_and_frees_the_blocks(service, monkeypatch):
    """The arena could not be mapped in vLLM's worker (after the pool was configured): the
    planner still reserves and asks vLLM to keep the request's blocks, so the worker must give
    the slots back and still report the request finished sending, or both leak for good."""
    import kv_connector.pool_copier as pool_copier

    def refuse(info, readonly=False):
        raise PermissionError(13, "Permission denied", info.path)

    monkeypatch.setattr(pool_copier.Arena, "attach", staticmethod(refuse))
    worker = PoolCopier(connect(service), BS)
    source = caches()
    worker.register_kv_caches(source)
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    planner.bind_kv_cache_manager(FakeManager({"a": [0, 1, 2]}))
    req = FakeRequest("a", list(range(2 * BS + 1)))
    planner.matched_tokens(req, 0)
    planner.after_alloc(req, blocks_of([0, 1, 2]), 0)
    _, saves, _ = planner.plan(step(new={"a": 0}, scheduled={"a": 2 * BS + 1}))
    assert saves and service.pool.reserved_slots(list(saves[0].keys))
    save_step(worker, saves, source)
    assert planner.finished(req)[0] is True
    assert worker.finished_saving({"a"}) == {"a"}  # vLLM may free the blocks
    deadline = time.monotonic() + 5  # the abort is sent without an answer
    while service.pool.reserved_slots(list(saves[0].keys)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.pool.reserved_slots(list(saves[0].keys)) == []
    worker.shutdown()


def test_a_preempted_requests_saves_land_before_its_blocks_are_reused(service):
    service.configure(LAYERS * int(torch.zeros(BLOCK_SHAPE).numel() * 4), "x")
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    planner.bind_kv_cache_manager(FakeManager({"a": [0, 1]}))
    req = FakeRequest("a", list(range(2 * BS + 1)))
    planner.after_alloc(req, blocks_of([0, 1]), 0)
    planner.plan(step(new={"a": 0}, scheduled={"a": 2 * BS + 1}))
    _, _, flush = planner.plan(step(preempted={"a"}))
    assert flush == ("a",)


def test_an_unreachable_pool_is_a_cache_miss_not_an_error(tmp_path):
    from mooncake.control import ControlEndpoint

    planner = PoolPlanner(PoolClient(ControlEndpoint(str(tmp_path / "nobody.sock"), "00" * 16), 0.2), BS)
    assert planner.matched_tokens(FakeRequest("a", list(range(3 * BS))), 0) == (0, False)
    assert planner.stats.pool_errors == 1


def test_a_fetch_instruction_loads_the_other_pools_prefix_asynchronously_once(service):
    service.configure(LAYERS * int(torch.zeros(BLOCK_SHAPE).numel() * 4), "x")
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    params = {"mooncake_fetch": {"peer": "{}", "num_tokens": 3 * BS}}
    req = FakeRequest("f", list(range(4 * BS)), params)
    assert planner.matched_tokens(req, 0) == (3 * BS, True)  # nothing here: all of it comes from the peer
    assert planner.matched_tokens(req, 0) == (3 * BS, True)  # asked again: the same answer
    planner.after_alloc(req, blocks_of([0, 1, 2, 3]), 3 * BS)
    loads, _, _ = planner.plan(step())
    assert [(l.block_ids, l.sync, l.peer) for l in loads] == [((0, 1, 2), False, "{}")]
    assert planner.matched_tokens(req, 0) == (0, False)  # after a failed load vLLM recomputes: no retry
    assert planner.finished(req) == (False, 3 * BS)  # what it loaded: its prefill time is no compute sample
    # A request preempted after its first token fetches nothing (an asynchronous load of a
    # resumed request: see the next test), and its prefill was measured before.
    resumed = FakeRequest("g", list(range(4 * BS)), params, num_output_tokens=2, num_preemptions=1)
    assert planner.matched_tokens(resumed, 0) == (0, False)
    assert planner.finished(resumed) == (False, 0)


def test_a_resumed_request_loads_only_what_dram_holds(service, monkeypatch):
    """A preempted request may hold its blocks past its end for its earlier saves or pushes. An
    asynchronous load (SSD blocks, a fetch) would be a second hold: aborted during it, vLLM freed
    the blocks at the saves' report while the load still wrote into them, and the load's own
    report then failed vLLM's scheduler (an audit's repro). It loads the DRAM-held lead only,
    synchronously, and computes the rest."""
    planner = PoolPlanner(PoolClient(service.endpoint), BS)
    monkeypatch.setattr(planner._client, "lookup", lambda keys: ["dram", "ssd", "ssd"][:len(keys)])
    tokens = list(range(4 * BS))
    assert planner.matched_tokens(FakeRequest("new", tokens), 0) == (3 * BS, True)  # a new one waits for SSD
    assert planner.matched_tokens(FakeRequest("back", tokens, num_preemptions=1), 0) == (BS, False)
    monkeypatch.setattr(planner._client, "lookup", lambda keys: ["ssd"] * len(keys))
    assert planner.matched_tokens(FakeRequest("again", tokens, num_preemptions=2), 0) == (0, False)


def test_the_conductor_fetches_only_from_a_holder_whose_pool_it_can_reach():
    pytest.importorskip("fastapi", reason="the conductor's routing needs it (absent on a bare GPU machine)")
    from conductor.core.types import Decision
    from conductor.routing import fetch_params
    from conductor.workers import WorkerHandle

    decision = Decision(request_id="r", prefill_instance="p0", decode_instance="d0", cached_prefix_tokens=512,
                        fetch_from="p1", fetched_blocks=4, predicted_ttft_s=0.1, predicted_tbt_s=0.01,
                        predicted_queue_s=0.0, predicted_prefill_s=0.05, predicted_transfer_s=0.05)
    holder = WorkerHandle("http://p1", pool_peer='{"name": "p1"}')
    assert fetch_params(decision, {"p1": holder}).to_params() == {
        "mooncake_fetch": {"peer": '{"name": "p1"}', "num_tokens": 512}}
    assert fetch_params(decision, {"p1": WorkerHandle("http://p1")}) is None  # no pool to fetch from
    assert fetch_params(decision, {}) is None  # the holder left
