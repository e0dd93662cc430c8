"""The KV sender (prefill/kv_sender.py) when a push goes wrong, over real loopback engines: what it
holds is released, the request's blocks are freed in bounded time, and a push whose KV turned out
wrong is never reported landed. (The data path itself: tests/spine/test_connector_datapath.py.)
"""

import socket
import time

import msgspec
import numpy as np
import pytest
import torch

from messenger.engine import EngineConfig, TransferEngine
from mooncake.protocol import KV_CALL_DECODER, KV_CALL_ENCODER, KVHello, KVReserved
from prefill import kv_sender
from prefill.kv_sender import KVSender
from tests.spine.test_connector_datapath import (BLOCK, BLOCKS, DIM, HEADS, LAYERS, caches, make_consumer, save, spec,
                                                 wait_freed)

TIMEOUT_S = 2.0
ENGINE = EngineConfig(transports=("tcp",), timeout_s=TIMEOUT_S)


def producer_of(kv_caches):
    engine = TransferEngine("producer", ENGINE)
    producer = KVSender(engine, timeout_s=TIMEOUT_S)
    producer.register_kv_caches(kv_caches, BLOCKS)
    engine.start()
    return engine, producer


@pytest.fixture
def blocks_first():
    src = caches(True)
    engine, producer = producer_of(src)
    yield engine, producer, src
    producer.shutdown()
    engine.close()


def gathered_regions(engine) -> list[str]:
    return [region.name for region in engine.info().regions if region.name.startswith("kv-rows-")]


def test_the_gathered_rows_of_a_push_that_failed_are_released():
    """K and V first (FlashAttention's layout; a CUDA cache always): each layer's rows are
    gathered into a buffer of their own (pinned on a GPU). A push that fails before its batch
    is written must give them back, or every failed push leaks its prompt's KV."""
    src = {f"model.layers.{i}.attn": torch.rand(2, BLOCKS, BLOCK, HEADS, DIM) for i in range(LAYERS)}
    engine, producer = producer_of(src)
    try:
        for n in range(3):  # a worker that is gone: its hello fails, then every push fails at once
            save(producer, src, [spec(f"r{n}", "127.0.0.1:1", (1, 2, 3), 0, 4, final=True)])
        for n in range(3):
            wait_freed(producer, f"r{n}")
            assert producer.outcome(f"t-r{n}", 0) != "ok"
        assert gathered_regions(engine) == []
    finally:
        producer.shutdown()
        engine.close()


def test_a_write_that_raises_at_once_still_frees_the_request(blocks_first):
    """The decode worker names a slot its region cannot hold (a stale description): the engine
    refuses the write before any batch exists, so no completion would count it out."""
    engine, producer, src = blocks_first
    consumer = TransferEngine("consumer", ENGINE)
    consumer.register("staging", np.zeros(1 << 20, np.uint8))

    def on_call(peer, request):
        if isinstance(KV_CALL_DECODER.decode(request), KVHello):
            return msgspec.json.encode(consumer.info())
        return KV_CALL_ENCODER.encode(KVReserved(region="staging", offset=(1 << 20) - 100))

    consumer.start(on_call=on_call)
    try:
        save(producer, src, [spec("w", consumer.info().transports["tcp"], (1, 2), 0, 2, final=True)])
        wait_freed(producer, "w")
        assert "outside" in producer.outcome("t-w", 0)
    finally:
        consumer.close()


def test_pushes_queued_behind_an_unreachable_decode_worker_fail_together(blocks_first, monkeypatch):
    """A frozen decode worker (it accepts connections, answers nothing): the first push waits out
    the timeout; those queued behind it fail at once instead of each waiting its own, holding
    their blocks meanwhile."""
    engine, producer, src = blocks_first
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)
    dest = f"127.0.0.1:{frozen.getsockname()[1]}"
    try:
        start = time.monotonic()
        for n in range(6):
            save(producer, src, [spec(f"f{n}", dest, (n,), 0, 1, final=True)])
        for n in range(6):
            wait_freed(producer, f"f{n}", timeout=3 * TIMEOUT_S)
        assert time.monotonic() - start < 2 * TIMEOUT_S + 1.0  # one timeout (and a hello's), not six
        assert all(producer.outcome(f"t-f{n}", 0) not in (None, "ok") for n in range(6))
        assert "unreachable" in producer.outcome("t-f5", 0)
    finally:
        frozen.close()
    # Once the back-off is over, the worker is tried again (here a live one on another address).
    monkeypatch.setattr(kv_sender, "UNREACHABLE_BACKOFF_S", 0.0)
    c_engine, _ = make_consumer(caches(False))
    try:
        save(producer, src, [spec("g", c_engine.info().transports["tcp"], (1,), 0, 1, final=True)])
        assert producer.outcome("t-g", 10.0) == "ok"
    finally:
        c_engine.close()


def test_a_push_invalidated_after_it_landed_is_reported_failed(blocks_first):
    """vLLM reported blocks of the step invalid (a pool load failed) after the push went: the
    answer must not say the KV landed, or the decode worker would use it."""
    engine, producer, src = blocks_first
    c_engine, _ = make_consumer(caches(False))
    try:
        save(producer, src, [spec("a", c_engine.info().transports["tcp"], (1, 2), 0, 2, final=True)])
        assert producer.outcome("t-a", 10.0) == "ok"
        producer.invalidate("a", "t-a", "computed over KV that failed to load")
        assert producer.outcome("t-a", 0) == "computed over KV that failed to load"
        assert producer.stats()["pushed_transfers"] == 0 and producer.stats()["push_failures"] == 1
        wait_freed(producer, "a")
        producer.invalidate("a", "t-a", "too late")  # once freed, the shell has had its answer
        assert producer.outcome("t-a", 0) == "computed over KV that failed to load"
    finally:
        c_engine.close()


def test_a_push_to_a_decode_worker_known_unreachable_gathers_no_rows(monkeypatch):
    """Gathered rows are pinned host memory on a GPU, allocated on vLLM's forward thread per
    layer and step. For a transfer that has failed, or whose decode worker was just found
    unreachable, they were gathered anyway, only to be released unsent."""
    src = {f"model.layers.{i}.attn": torch.rand(2, BLOCKS, BLOCK, HEADS, DIM) for i in range(LAYERS)}
    engine, producer = producer_of(src)
    gathered = []
    gather = KVSender._gather
    monkeypatch.setattr(KVSender, "_gather", lambda self, *a: gathered.append(a[2]) or gather(self, *a))
    try:
        save(producer, src, [spec("first", "127.0.0.1:1", (1, 2, 3), 0, 4, final=True)])  # finds it unreachable
        wait_freed(producer, "first")
        assert len(gathered) == LAYERS
        for n in range(3):  # within the back-off: failed at once, nothing gathered
            save(producer, src, [spec(f"r{n}", "127.0.0.1:1", (1, 2, 3), 0, 4, final=True)])
            wait_freed(producer, f"r{n}")
            assert "unreachable" in producer.outcome(f"t-r{n}", 0)
        assert len(gathered) == LAYERS and gathered_regions(engine) == []
    finally:
        producer.shutdown()
        engine.close()
