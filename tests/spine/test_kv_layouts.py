"""The KV path on every cache layout an engine may hand the connector (mooncake/kv_layout.py),
on the CPU and, where one exists, on a CUDA device (skipped without one; the CPU-only CI never
runs those): blocks first, kernel blocks (a scheduler block is two rows), and K/V first.

A producer and a consumer, each on its own transfer engine over real loopback, push a request's
blocks in two chunks and land them into other block ids; every byte must arrive in the right
block of the consumer's layout, and layouts whose blocks differ must be refused before a byte
moves. The pool copier saves from one layout and loads into another the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadSpec
from decode.staging import StagingConfig
from kv_connector.pool_copier import PoolCopier
from kv_connector.pool_planner import PoolPlanner
from messenger.engine import EngineConfig, TransferEngine
from mooncake.hashing import hash_prompt_blocks
from mooncake.kv_layout import block_bytes, blocks_first, direct, num_blocks_of
from prefill.kv_sender import KVSender
from store.channel import PoolClient
from store.config import PoolConfig
from store.service import PoolService
from tests.spine.test_connector_datapath import save, spec, wait_loaded
from tests.spine.test_pool_connector import FakeManager, FakeRequest, blocks_of, step

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 24, 4, 2, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


def layer_cache(layout: str, device: str, fill: bool, seed: int) -> torch.Tensor:
    """One layer's cache as an engine with this layout allocates it (bf16, as served)."""
    shape = {"blocks_first": (BLOCKS, 2, BLOCK, HEADS, DIM),
             "kernel_blocks": (BLOCKS * 2, 2, BLOCK // 2, HEADS, DIM),
             "kv_first": (2, BLOCKS, BLOCK, HEADS, DIM)}[layout]
    if not fill:
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen).to(torch.bfloat16).to(device)


def caches(layout: str, device: str, fill: bool) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.attn": layer_cache(layout, device, fill, seed=i) for i in range(LAYERS)}


@pytest.mark.parametrize("layout", ["blocks_first", "kernel_blocks", "kv_first"])
def test_the_view_has_one_scheduler_block_per_row(layout):
    cache = layer_cache(layout, "cpu", True, 0)
    view = blocks_first(cache, BLOCKS)
    assert view.shape[0] == BLOCKS and view.data_ptr() == cache.data_ptr()  # a view, no copy
    assert block_bytes(view) == cache.numel() * 2 // BLOCKS
    assert direct(view) == (layout != "kv_first")  # K/V first: a block is two strided pieces
    if layout == "kv_first":
        assert torch.equal(view[5, 0], cache[0, 5]) and torch.equal(view[5, 1], cache[1, 5])
    elif layout == "kernel_blocks":
        assert torch.equal(view[5, 1], cache[11])
    assert blocks_first(cache) is cache  # the engine did not say: dim 0 as it is


def test_a_cache_without_the_blocks_is_refused_clearly():
    with pytest.raises(ValueError, match="neither 7 blocks"):
        blocks_first(torch.zeros(10, 3), 7)


def test_the_block_count_comes_from_whichever_engine_config_has_it():
    assert num_blocks_of(None, SimpleNamespace(num_blocks=12)) == 12
    assert num_blocks_of(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=9)), None) == 9
    assert num_blocks_of(SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=None)), None) is None


@contextmanager
def pair(src, dst, transports):
    """A producer and a consumer on their own engines; everything closed after."""
    config = EngineConfig(transports=transports, timeout_s=5.0)
    c_engine, p_engine = TransferEngine("consumer", config), TransferEngine("producer", config)
    consumer = KVReceiver(c_engine, BLOCK, StagingConfig(capacity_bytes=16 << 20))
    producer = KVSender(p_engine, timeout_s=5.0)
    try:
        consumer.register_kv_caches(dst, BLOCKS)
        c_engine.start(on_notify=consumer.on_notify, on_call=consumer.on_call)
        producer.register_kv_caches(src, BLOCKS)
        p_engine.start()
        yield producer, consumer, p_engine, c_engine.info().transports["tcp"]
    finally:
        consumer.shutdown()
        producer.shutdown()
        p_engine.close()
        c_engine.close()


@pytest.mark.parametrize("transports", [("tcp",), ("shm", "tcp")], ids=["tcp", "shm"])
@pytest.mark.parametrize("src_layout,dst_layout", [("kv_first", "blocks_first"), ("blocks_first", "kv_first"),
                                                   ("kernel_blocks", "kernel_blocks")])
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_land_in_the_consumers_layout(device, src_layout, dst_layout, transports):
    src, dst = caches(src_layout, device, True), caches(dst_layout, device, False)
    with pair(src, dst, transports) as (producer, consumer, p_engine, dest):
        save(producer, src, [spec("p", dest, (5, 6), 0, 4, final=False)])  # first chunk: blocks 0-1
        save(producer, src, [spec("p", dest, (20, 3), 2, 4, final=True)])  # last chunk: blocks 2-3
        assert producer.outcome("t-p", 10.0) == "ok"
        consumer.start_load_kv([LoadSpec("d", "t-p", block_ids=(0, 17, 9, 23), first_block=0, num_tokens=15,
                                         wait_timeout_s=10)])
        assert wait_loaded(consumer, "d", timeout=10.0) == set()
        assert consumer.arena_pinned == (device == "cuda")  # landing on a GPU reads a page-locked arena
        for name in src:
            sent, got = blocks_first(src[name], BLOCKS), blocks_first(dst[name], BLOCKS)
            for s, d in ((5, 0), (6, 17), (20, 9), (3, 23)):
                assert torch.equal(got[d], sent[s]), (name, s, d)
            assert got[1].abs().sum() == 0  # untouched blocks stay untouched
        assert p_engine.stats()[transports[0]]["sent_bytes"] > 0
        assert producer.finished_sending({"p"}) == {"p"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gather_on_the_side_stream_reads_its_own_block_ids_not_the_forwards_next_tensor():
    """The sender gathers a layer's rows on its side stream while the forward's stream goes on. Here
    the side stream is held back (a sleep kernel) and the forward's stream at once allocates a
    tensor of the ids' size and fills it: had the ids been made on the forward's stream, that
    tensor would get their freed memory, and the gather would read the wrong blocks."""
    src, dst = caches("kv_first", "cuda", True), caches("blocks_first", "cuda", False)
    with pair(src, dst, ("tcp",)) as (producer, consumer, p_engine, dest):
        first = spec("p", dest, (5, 6, 7, 8), 0, 8, final=False)
        last = spec("p", dest, (20, 3, 11, 2), 4, 8, final=True)
        for chunk in (first, last):
            for name, cache in src.items():
                producer._copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(producer._copy_stream):
                    torch.cuda._sleep(50_000_000)  # tens of ms before the gather may run
                producer.save_kv_layer([chunk], name, cache)
                torch.full((len(chunk.block_ids),), BLOCKS - 1, dtype=torch.long, device="cuda")  # the forward
            producer.wait_for_save()
        assert producer.outcome("t-p", 20.0) == "ok"
        ids = (0, 17, 9, 23, 1, 4, 12, 13)
        consumer.start_load_kv([LoadSpec("d", "t-p", block_ids=ids, first_block=0, num_tokens=31, wait_timeout_s=20)])
        assert wait_loaded(consumer, "d", timeout=20.0) == set()
        for name in src:
            sent, got = blocks_first(src[name], BLOCKS), blocks_first(dst[name], BLOCKS)
            for s, d in zip((5, 6, 7, 8, 20, 3, 11, 2), ids):
                assert torch.equal(got[d], sent[s]), (name, s, d)
        assert producer.finished_sending({"p"}) == {"p"}


def test_layouts_whose_blocks_differ_are_refused_before_a_byte_moves():
    src, dst = caches("kernel_blocks", "cpu", True), caches("blocks_first", "cpu", False)
    with pair(src, dst, ("tcp",)) as (producer, consumer, _, dest):
        save(producer, src, [spec("p", dest, (0,), 0, 1, final=True)])
        assert "layout" in producer.outcome("t-p", 5.0)
        assert consumer.stats()["staged_bytes"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_pool_saves_from_one_layout_and_loads_into_another(device):
    source, target = caches("kv_first", device, True), caches("blocks_first", device, False)
    size = block_bytes(blocks_first(source["model.layers.0.attn"], BLOCKS)) * LAYERS
    service = PoolService(PoolConfig(dram_bytes=8 * size, ssd_dir=None), remote=False).start()
    writer = PoolCopier(lambda t: PoolClient(service.endpoint, t), BLOCK)
    reader = PoolCopier(lambda t: PoolClient(service.endpoint, t), BLOCK)
    tokens = list(range(100, 100 + 3 * BLOCK + 2))  # 3 full blocks and a partial one
    try:
        writer.register_kv_caches(source, BLOCKS)
        reader.register_kv_caches(target, BLOCKS)
        planner = PoolPlanner(PoolClient(service.endpoint), BLOCK)
        planner.bind_kv_cache_manager(FakeManager({"a": [7, 2, 19, 5]}))
        planner.after_alloc(FakeRequest("a", tokens), blocks_of([7, 2, 19, 5]), 0)
        _, saves, _ = planner.plan(step(new={"a": 0}, scheduled={"a": len(tokens)}))
        for name in source:
            writer.save_layer(saves, name)
        writer.flush(["a"])  # both save stages done, the keys committed
        assert service.lookup(hash_prompt_blocks(tokens, BLOCK)) == ["dram"] * 3
        loader = PoolPlanner(PoolClient(service.endpoint), BLOCK)
        loader.bind_kv_cache_manager(FakeManager({"b": [1, 12, 4, 6]}))
        request = FakeRequest("b", tokens[:3 * BLOCK] + [7, 7, 7])
        assert loader.matched_tokens(request, 0) == (3 * BLOCK, False)
        loader.after_alloc(request, blocks_of([1, 12, 4, 6]), 3 * BLOCK)
        loads, _, _ = loader.plan(step(new={"b": 3 * BLOCK}, scheduled={"b": 3}))
        reader.start_loads(loads)
        for name in target:
            reader.wait_for_layer(name)
            got, sent = blocks_first(target[name], BLOCKS), blocks_first(source[name], BLOCKS)
            assert torch.equal(got[[1, 12, 4]], sent[[7, 2, 19]]), name
        assert reader.take_invalid_blocks() == set()
    finally:
        writer.shutdown()
        reader.shutdown()
        service.close()


def test_split_runs_shares_a_copy_among_threads_without_losing_or_repeating_a_row():
    # The pool copier cuts its runs of slots with the messenger's cut of copies (messenger/cma.py).
    from messenger.cma import split as split_runs
    from mooncake.kv_layout import runs

    for ids in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [5, 9, 2, 7], [], [3], [*range(10), *range(20, 23)]):
        for parts in (1, 2, 3, 4):
            split = split_runs(runs(ids), parts)
            rows = [(position + i, first + i) for part in split for position, first, count in part for i in range(count)]
            assert rows == list(enumerate(ids))
            assert len(split) <= parts
            sizes = [sum(count for _, _, count in part) for part in split]
            assert not sizes or max(sizes) - min(sizes) <= max(sizes) // 2 + 1  # about equal shares
