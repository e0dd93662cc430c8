"""The connector's data path without vLLM: a KVSender and a KVReceiver over real loopback TCP.

A producer holds paged caches filled with known values, pushes the blocks of a request layer by
layer; the consumer lands them into *different* block ids of its own caches. Every byte must
arrive where the scheduler asked, and corruption must turn into a reported failure.
"""

import time

import pytest
import torch

from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadSpec
from decode.staging import StagingConfig
from messenger.tcp import TcpConfig
from prefill.kv_sender import KVSender
from prefill.push_planner import SaveSpec

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 12, 4, 2, 8


def caches(fill: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = {}
    for i in range(LAYERS):
        shape = (BLOCKS, 2, BLOCK, HEADS, DIM)
        out[f"model.layers.{i}.attn"] = torch.rand(shape, generator=gen) if fill else torch.zeros(shape)
    return out


@pytest.fixture
def pair():
    producer = KVSender(TcpConfig())
    consumer = KVReceiver("127.0.0.1", 0, BLOCK, StagingConfig(), TcpConfig())
    src, dst = caches(True), caches(False)
    producer.register_kv_caches(src)
    consumer.register_kv_caches(dst)
    yield producer, consumer, src, dst
    producer.shutdown()
    consumer.shutdown()


def push(producer, src, spec):
    for name, tensor in src.items():
        producer.save_kv_layer([spec], name, tensor)
    producer.wait_for_save()


def wait_loaded(consumer, req_id, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        finished, failed = consumer.collect_loads(set())
        if req_id in finished:
            return failed
        time.sleep(0.01)
    raise AssertionError("load never finished")


def test_blocks_land_exactly_where_the_consumer_allocated(pair):
    producer, consumer, src, dst = pair
    dest = consumer.address
    push(producer, src, SaveSpec("p1", "t1", dest, block_ids=(5, 2, 9), num_tokens=11))
    consumer.start_load_kv([
        LoadSpec("d1", "t1", block_ids=(0, 7, 3), first_block=0, num_tokens=11, wait_timeout_s=5)])
    assert wait_loaded(consumer, "d1") == set()
    for name in src:
        for s, d in ((5, 0), (2, 7), (9, 3)):
            assert torch.equal(dst[name][d], src[name][s])
        assert dst[name][1].abs().sum() == 0  # untouched blocks stay untouched


def test_locally_cached_prefix_blocks_are_not_overwritten(pair):
    producer, consumer, src, dst = pair
    push(producer, src, SaveSpec("p", "t", consumer.address, block_ids=(1, 2, 3), num_tokens=12))
    consumer.start_load_kv([
        LoadSpec("d", "t", block_ids=(10, 11), first_block=1, num_tokens=12, wait_timeout_s=5)])
    wait_loaded(consumer, "d")
    for name in src:
        assert torch.equal(dst[name][10], src[name][2]) and torch.equal(dst[name][11], src[name][3])
    stats = consumer.stats()
    assert stats["loaded_transfers"] == 1 and stats["loaded_tokens"] == 12 - BLOCK


def test_corrupted_payload_is_refused_and_reported_failed(pair):
    producer, consumer, src, dst = pair
    reply = consumer._on_frame({"op": "put", "transfer_id": "bad", "layer_index": 0, "num_layers": LAYERS,
                                "layer_name": "model.layers.0.attn", "num_tokens": 4, "shape": [1, 4],
                                "dtype": "float32", "xxh3": "0000000000000000"}, bytearray(16))
    assert reply["ok"] is False and "checksum" in reply["error"]
    consumer.start_load_kv([
        LoadSpec("d", "bad", block_ids=(0,), first_block=0, num_tokens=4, wait_timeout_s=5)])
    finished, failed = consumer.collect_loads(set())
    assert finished == {"d"} and failed == {"d"}
    assert all(t.abs().sum() == 0 for t in dst.values())


def test_missing_kv_times_out_into_a_failure_not_a_hang(pair):
    _, consumer, _, _ = pair
    consumer.start_load_kv([
        LoadSpec("d", "never", block_ids=(0,), first_block=0, num_tokens=4, wait_timeout_s=0.05)])
    assert consumer.collect_loads(set()) == (set(), set())
    time.sleep(0.1)
    assert consumer.collect_loads(set()) == ({"d"}, {"d"})


def test_push_to_dead_peer_is_counted_not_raised(pair):
    producer, _, src, _ = pair
    push(producer, src, SaveSpec("p", "t", "127.0.0.1:1", block_ids=(0,), num_tokens=4))
    assert producer.stats()["push_failures"] == 1


def test_layout_mismatch_fails_cleanly():
    producer = KVSender(TcpConfig())
    consumer = KVReceiver("127.0.0.1", 0, BLOCK, StagingConfig(), TcpConfig())
    src = caches(True)
    dst = {k: torch.zeros(BLOCKS, 2, BLOCK, HEADS, DIM * 2) for k in src}  # other head_dim
    producer.register_kv_caches(src)
    consumer.register_kv_caches(dst)
    try:
        push(producer, src, SaveSpec("p", "t", consumer.address, block_ids=(0,), num_tokens=4))
        consumer.start_load_kv([
            LoadSpec("d", "t", block_ids=(0,), first_block=0, num_tokens=4, wait_timeout_s=5)])
        assert wait_loaded(consumer, "d") == {"d"}
    finally:
        producer.shutdown()
        consumer.shutdown()
