"""The decode worker's KVReceiver against vLLM's contract, without a transfer engine: the test
plays the prefill (it reserves through `on_call`, writes into the registered arena and sends the
layer notes to `on_notify`) and the control thread (drop), interleaved with `collect_loads`.

vLLM keeps the blocks of a request waiting for its KV until the worker reports it in
finished_recving, also when it was aborted meanwhile; a load must never report wrong bytes as a
success, and nothing in landing may raise out of `collect_loads` (it would end vLLM's worker).
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from decode import kv_receiver
from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadSpec
from decode.staging import StagingConfig
from messenger.api import NotifyRefused
from mooncake.protocol import KV_CALL_ENCODER, KV_RESERVED_DECODER, KVLayerNote, KVReserve

LAYERS, BLOCKS, BLOCK, SHAPE = 2, 16, 4, (2, 4, 2, 8)  # one block: K and V, BLOCK tokens, 2 heads of 8
BLOCK_BYTES = int(np.prod(SHAPE)) * 4  # float32


class FakeEngine:
    """What the receiver needs of a TransferEngine: the regions it registers (the prefill's writes
    land there)."""

    def __init__(self):
        self.regions: dict[str, np.ndarray] = {}

    def register(self, name: str, array: np.ndarray) -> None:
        self.regions[name] = array


class Clock:
    """decode.kv_receiver's `time`, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(kv_receiver, "time", clock)
    return clock


def receiver(ttl_s: float = 120.0):
    engine = FakeEngine()
    consumer = KVReceiver(engine, BLOCK, StagingConfig(capacity_bytes=1 << 20, ttl_s=ttl_s, pin_for_cuda=False))
    caches = {f"model.layers.{i}.attn": torch.zeros(BLOCKS, *SHAPE) for i in range(LAYERS)}
    consumer.register_kv_caches(caches, BLOCKS)
    return SimpleNamespace(consumer=consumer, caches=caches, arena=engine.regions[kv_receiver.STAGING_REGION])


def reserve(r, transfer_id: str, num_blocks: int) -> int:
    layers = [(name, "float32", list(SHAPE)) for name in r.caches]
    reply = KV_RESERVED_DECODER.decode(r.consumer.on_call("prefill", KV_CALL_ENCODER.encode(
        KVReserve(transfer_id, 0, num_blocks, BLOCK_BYTES, layers))))
    assert reply.error is None
    return reply.offset


def push_layer(r, transfer_id: str, slot: int, layer: int, num_blocks: int) -> np.ndarray:
    """Write `layer`'s blocks (distinct values) into the slot and note them; returns the bytes."""
    begin = slot + layer * num_blocks * BLOCK_BYTES
    values = np.arange(num_blocks * BLOCK_BYTES // 4, dtype=np.float32) + 1000 * (layer + 1)
    r.arena[begin: begin + values.nbytes] = values.view(np.uint8)
    r.consumer.on_notify("prefill", KV_CALL_ENCODER.encode(KVLayerNote(transfer_id, layer, 0, num_blocks, slot)), None)
    return values


def landed_bytes(r, layer: int, block_ids) -> np.ndarray:
    return r.caches[f"model.layers.{layer}.attn"][list(block_ids)].contiguous().view(-1).numpy()


def load(request_id: str, transfer_id: str, block_ids, wait_timeout_s: float = 30.0) -> LoadSpec:
    return LoadSpec(request_id, transfer_id, tuple(block_ids), first_block=0,
                    num_tokens=len(block_ids) * BLOCK, wait_timeout_s=wait_timeout_s)


def test_a_request_aborted_while_waiting_for_its_kv_is_reported_finished_once(clock):
    """Otherwise vLLM never frees its blocks (WAITING_FOR_REMOTE_KVS: a delayed free)."""
    r = receiver()
    slot = reserve(r, "t", 3)
    push_layer(r, "t", slot, 0, 3)  # layer 1 is still on its way
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7))])
    assert r.consumer.collect_loads(set()) == (set(), set())
    assert r.consumer.collect_loads({"d"}) == ({"d"}, set())  # finished, not failed: nothing to recompute
    assert r.consumer.collect_loads({"d"}) == (set(), set())  # once
    with pytest.raises(NotifyRefused):  # late: the prefill's push fails instead of counting as landed
        push_layer(r, "t", slot, 1, 3)
    assert r.consumer.collect_loads(set()) == (set(), set())


def test_a_drop_between_finding_the_transfer_complete_and_copying_it_still_lands_the_right_bytes(
        clock, monkeypatch):
    """The control thread's drop (the client left) just before the copy starts."""
    r = receiver()
    slot = reserve(r, "t", 3)
    sent = [push_layer(r, "t", slot, layer, 3) for layer in range(LAYERS)]
    land = r.consumer._land

    def drop_then_land(spec, staged):
        r.consumer.drop(spec.transfer_id)
        return land(spec, staged)

    monkeypatch.setattr(r.consumer, "_land", drop_then_land)
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7))])
    assert r.consumer.collect_loads(set()) == ({"d"}, set())
    for layer in range(LAYERS):
        assert np.array_equal(landed_bytes(r, layer, (5, 6, 7)), sent[layer])
    assert r.consumer.stats()["staged_bytes"] == 0  # the slot came back once, after the copy


def test_a_drop_or_a_new_reservation_during_the_copy_never_yields_wrong_bytes(clock, monkeypatch):
    """The slot being copied from must not be freed (and handed to the next reservation, whose
    bytes would then be loaded as this request's) before the copy ends."""
    r = receiver()
    slot = reserve(r, "t", 3)
    sent = [push_layer(r, "t", slot, layer, 3) for layer in range(LAYERS)]
    copyto, copies = np.copyto, []

    def copy_while_the_control_thread_drops(dst, src):
        if not copies:  # during layer 0's copy: a drop, then another transfer's push
            r.consumer.drop("t")
            other = reserve(r, "u", 3)
            for layer in range(LAYERS):
                push_layer(r, "u", other, layer, 3)
        copies.append(1)
        return copyto(dst, src)

    monkeypatch.setattr(np, "copyto", copy_while_the_control_thread_drops)
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7))])
    finished, failed = r.consumer.collect_loads(set())
    assert finished == {"d"}
    if not failed:
        for layer in range(LAYERS):
            assert np.array_equal(landed_bytes(r, layer, (5, 6, 7)), sent[layer])


def test_landing_that_raises_is_a_failed_load_not_a_crash(clock, monkeypatch):
    r = receiver()
    slot = reserve(r, "t", 3)
    for layer in range(LAYERS):
        push_layer(r, "t", slot, layer, 3)

    def broken_copy(dst, src):
        raise ValueError("could not broadcast input array")

    monkeypatch.setattr(np, "copyto", broken_copy)
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7))])
    assert r.consumer.collect_loads(set()) == ({"d"}, {"d"})  # vLLM recomputes the prompt
    assert r.consumer.stats()["load_failures"] == 1 and r.consumer.stats()["staged_bytes"] == 0


def test_a_pull_of_a_transfer_that_expired_fails_at_once(clock):
    """The pull must not wait out its timeout for bytes that were dropped; and the prefill's push
    of a later layer fails (the engine fails the sender's batch), so it does not report "ok"."""
    r = receiver(ttl_s=10.0)
    slot = reserve(r, "t", 3)
    push_layer(r, "t", slot, 0, 3)
    clock.now += 11.0
    r.consumer.collect_loads(set())  # any step expires it
    with pytest.raises(NotifyRefused):  # too late
        push_layer(r, "t", slot, 1, 3)
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7), wait_timeout_s=30.0)])
    assert r.consumer.collect_loads(set()) == ({"d"}, {"d"})


def test_a_push_whose_layers_keep_landing_outlives_the_ttl(clock):
    r = receiver(ttl_s=10.0)
    slot = reserve(r, "t", 3)
    sent = [push_layer(r, "t", slot, 0, 3)]
    clock.now += 8.0
    sent.append(push_layer(r, "t", slot, 1, 3))
    clock.now += 8.0  # 16 s after the reservation, 8 s after the last layer
    assert r.consumer.collect_loads(set()) == (set(), set())
    r.consumer.start_load_kv([load("d", "t", (5, 6, 7))])
    assert r.consumer.collect_loads(set()) == ({"d"}, set())
    for layer in range(LAYERS):
        assert np.array_equal(landed_bytes(r, layer, (5, 6, 7)), sent[layer])


def test_a_pull_of_a_prompt_the_decode_worker_already_caches_frees_the_staged_kv_at_once(clock):
    """The conductor's index lagged and the prefill pushed KV this worker's own prefix cache
    holds: vLLM's local hit covers the pull, nothing is loaded, and the staged bytes were held
    until the staging TTL. The scheduler half now names the transfer, and the worker frees it."""
    from decode.load_planner import LoadPlanner
    from kv_connector.connector import MooncakeServeConnector
    from kv_connector.metadata import ServeConnectorMetadata
    from mooncake.protocol import PullParams

    r = receiver()
    slot = reserve(r, "t-cached", 2)
    for layer in range(LAYERS):
        push_layer(r, "t-cached", slot, layer, 2)
    assert r.consumer.stats()["staged_bytes"] > 0

    planner = LoadPlanner(BLOCK)
    pull = PullParams(transfer_id="t-cached", num_tokens=2 * BLOCK, wait_timeout_s=30.0)
    request = SimpleNamespace(request_id="r", kv_transfer_params=pull.to_params(),
                              prompt_token_ids=list(range(2 * BLOCK + 1)))
    assert planner.matched_tokens(request, num_computed_tokens=2 * BLOCK) == (0, False)
    assert planner.matched_tokens(request, num_computed_tokens=2 * BLOCK) == (0, False)  # asked again: told once
    assert planner.take() == [] and planner.take_unclaimed() == ["t-cached"] and planner.take_unclaimed() == []

    worker = object.__new__(MooncakeServeConnector)
    worker._receiver = r.consumer
    worker._get_connector_metadata = lambda: ServeConnectorMetadata(unclaimed=["t-cached"])
    worker.start_load_kv(None)
    assert r.consumer.stats()["staged_bytes"] == 0


def test_an_idle_decode_worker_frees_expired_staging_for_the_next_reservation(clock):
    """Expiry ran only at engine steps, and an idle decode worker does not step: a push abandoned
    half-landed kept its (quarantined) slot for good, and the next prefill's reservation was
    refused as StagingFull, its prompt recomputed."""
    r = receiver(ttl_s=120.0)  # a 1 MiB arena
    n = (1 << 20) // (LAYERS * BLOCK_BYTES) - 8  # one transfer fills most of it
    slot = reserve(r, "abandoned", n)
    push_layer(r, "abandoned", slot, 0, n)  # its other layers never come (the client left)
    r.consumer.drop("abandoned")  # the conductor's drop: the slot is quarantined for the TTL
    clock.now += 3600  # an hour later, with no engine step in between
    reserve(r, "next", n)  # StagingFull before
