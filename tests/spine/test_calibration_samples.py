"""What a calibration sample is made of (conductor/routing.py Router.measured): a decode step is
priced at the load the request decoded under, not the load when it ended (conductor/ledger.py
decode_load); and a request's figures are its last attempt's, never a failed attempt's mixed in
(conductor/relay.py RelayStats, conductor/serving.py CompletionService._start). Real router,
ledger, relay and service; the worker client is a stand-in. Helpers are test_routing's and
test_calibration_live's."""

import asyncio

import pytest

from conductor.core import Estimators, Scheduler, SchedulerConfig, load_profile
from conductor.core.index import PrefixIndex
from conductor.ledger import Ledger
from conductor.metrics import ConductorMetrics
from conductor.relay import Relay, RelayStats
from conductor.routing import Route, Router
from conductor.schemas import CompletionRequest
from conductor.workers import WorkerError
from mooncake.protocol import GenerateChunk, Sampling
from tests.spine.test_calibration_live import service_for
from tests.spine.test_routing import BLOCK, pool_of

SHRINK = 1 / 5  # one sample against the prior weight of 4: scale = (measured / prior) ** (1 / 5)


def load_sensitive_router(pool) -> Router:
    """A router whose prior's decode step grows with batch and KV (the bf16 table's does; the
    float32 one's is flat, so the load a sample is priced at would not show)."""
    est = Estimators.from_profile(load_profile("smollm2-135m-cpu-bf16"))
    assert est.decode.d1 > 0 and est.decode.d2 > 0
    return Router(pool, PrefixIndex(), Scheduler(SchedulerConfig(block_size=BLOCK), est), ConductorMetrics())


def test_the_decode_load_is_the_time_weighted_mean_over_the_requests_decode():
    ledger = Ledger()
    ledger.assign("a", ledger, 0.1, 0.0, kv_tokens=100)
    ledger.prefill_done("a", ledger, now=0.0)
    for i in range(3):  # three others decode beside it from 2 s to 6 s
        ledger.assign(f"o{i}", ledger, 0.1, 0.0, kv_tokens=1000)
        ledger.prefill_done(f"o{i}", ledger, now=2.0)
    for i in range(3):
        ledger.finished(f"o{i}", ledger, now=6.0)
    # 10 s of decode: 4 s with 4 sequences (3,100 tokens), 6 s alone (100 tokens).
    assert ledger.decode_load("a", now=10.0) == pytest.approx(((4 * 4 + 6 * 1) / 10, (4 * 3100 + 6 * 100) / 10))
    assert ledger.running_load() == (1, 100)  # what it used to be priced at
    assert ledger.decode_load("nobody", now=10.0) is None
    ledger.finished("a", ledger, now=10.0)
    assert ledger.decode_marks == {} and ledger.decode_load("a", now=11.0) is None


def test_a_decode_sample_is_priced_at_the_load_it_decoded_under_not_the_load_when_it_ended():
    """It decoded beside 7 others and ended alone: priced at a batch of 1 (as it was), the steps
    the 7 slowed read as a host nearly twice as slow as it is."""
    pool = pool_of(("d1", "decode"))
    r = load_sensitive_router(pool)
    d1 = pool.handles["http://d1"]

    def decoding(name, kv_from, now):
        route = r._commit(Route(d1, d1, name), list(range(kv_from, kv_from + 500)), 12, now=now, cached=0,
                          tbt_slo_s=0.5)
        r.first_token(route, now=now)
        return route

    route = decoding("req", 0, 0.0)
    others = [decoding(f"o{i}", 1000 * (i + 1), 1.0) for i in range(7)]
    for other in others:
        r.finished(other, now=9.0)
    step_s = 0.02
    r.measured(RelayStats(decode_instance="d1", decode_step_s=step_s, decode_concurrent=0), route, now=10.0)
    # 1 s alone, 8 s with 8 sequences, 1 s alone; each holds 512 KV tokens.
    batch = (1 + 8 * 8 + 1) / 10
    prior = r.scheduler.estimators.tbt_s(batch, batch * 512)
    assert r.calibration.instance("d1").decode_step.scale == pytest.approx((step_s / prior) ** SHRINK)
    r.finished(route, now=10.0)


def test_a_decode_moved_to_another_worker_is_priced_at_the_load_there_from_the_move():
    """The new worker decodes it afresh and measures its own steps: the window starts at the move,
    on the new worker's ledger (d1's crowded batch before the move is none of it)."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    r = load_sensitive_router(pool)
    p1, d1, d2 = (pool.handles[f"http://{n}"] for n in ("p1", "d1", "d2"))

    def decoding(name, to, now):
        route = r._commit(Route(p1, to, name), list(range(500)), 12, now=now, cached=0, tbt_slo_s=0.5)
        r.first_token(route, now=now)
        return route

    crowd = [decoding(f"c{i}", d1, 0.0) for i in range(9)]
    route = decoding("req", d1, 0.0)
    beside = [decoding(f"b{i}", d2, 0.0) for i in range(3)]
    r.move_decode(route, d2, now=4.0)
    for other in beside:
        r.finished(other, now=6.0)
    step_s = 0.02
    r.measured(RelayStats(decode_instance="d2", decode_step_s=step_s, decode_concurrent=0), route, now=8.0)
    batch = (2 * 4 + 2 * 1) / 4  # on d2: 2 s beside the 3 others, 2 s alone
    prior = r.scheduler.estimators.tbt_s(batch, batch * 512)
    assert r.calibration.instance("d2").decode_step.scale == pytest.approx((step_s / prior) ** SHRINK)
    assert r.calibration.instance("d1").decode_step.samples == 0
    for other in [*crowd, route]:
        r.finished(other, now=8.0)


class FailoverClient:
    """Stands in for WorkerClient. A prefill worker answers its one token (`kv_error`: its push
    failed), then fails every later prompt; the first decode worker asked fails before its first
    token, after a token-less first chunk (as a prompt's logprobs can come) when `early_chunk`;
    the others answer with measured times."""

    def __init__(self, kv_error: str | None = None, early_chunk: bool = False):
        self.kv_error, self.early_chunk = kv_error, early_chunk
        self.calls: list[str] = []

    async def generate(self, handle, request):
        self.calls.append(handle.name)
        if handle.role == "prefill":
            if self.calls.count(handle.name) > 1:
                raise WorkerError(f"{handle.name} is down", worker=handle.name)
            yield GenerateChunk([7], finish_reason="length", num_cached_tokens=256, prefill_s=9.0,
                                prefill_concurrent=0, kv_error=self.kv_error)
            return
        if not any(c != "p1" for c in self.calls[:-1]):  # the first decode worker asked
            if self.early_chunk:
                yield GenerateChunk([], num_cached_tokens=256)
            raise WorkerError(f"{handle.name} crashed", worker=handle.name)
        yield GenerateChunk([1], num_cached_tokens=0)
        yield GenerateChunk([2] * (request.sampling.max_tokens - 1), finish_reason="length", prefill_s=0.05,
                            prefill_concurrent=0, decode_step_s=0.004, decode_concurrent=0)

    async def drop_transfer(self, handle, transfer_id):
        """Nothing to drop: this fake pushes no KV."""


def relayed_with_failover(client, prefill: str) -> RelayStats:
    """One request relayed on (prefill, d1), d1 failing before its first token and d2 taking it over."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    d1, d2 = pool.handles["http://d1"], pool.handles["http://d2"]
    relay = Relay(client, 1.0, pick_fallback=lambda tried: d2)
    stats = RelayStats()

    async def main():
        route = Route(pool.handles[f"http://{prefill}"], d1, "r")
        return [c async for c in relay.run("r", [5] * 300, Sampling(max_tokens=3), route, stats)]

    asyncio.run(main())
    return stats


def test_a_decode_moved_before_its_first_token_keeps_none_of_the_failed_workers_figures():
    """Colocated on d1, which reported 256 cached tokens and failed: d2 computed the prompt with
    none (the 256 stayed, and d2's prefill would have been fitted against d1's cache)."""
    stats = relayed_with_failover(FailoverClient(early_chunk=True), "d1")
    assert (stats.decode_instance, stats.prefill_instance) == ("d2", "d2")
    assert (stats.decode_cached_tokens, stats.prefill_cached_tokens, stats.computed_cached_tokens) == (0, 0, 0)


def test_a_prompt_computed_on_the_prefill_worker_stays_its_own_when_the_decode_moves():
    """P's push failed, so d1 was to recompute the prompt, and failed: P's measured 9 s was
    handed to d2 (prefill_instance moved to the fallback), whose prefill fit then learnt P's time."""
    stats = relayed_with_failover(FailoverClient(kv_error="push failed"), "p1")
    assert (stats.prefill_instance, stats.prefill_s, stats.decode_instance) == ("p1", 9.0, "d2")


def test_a_retried_request_is_sampled_from_its_last_attempt_alone():
    """p1 computed the prompt (9 s), its push failed, and d1 (to recompute) failed before its
    first token; p1 was down for the retry, so d2 took it whole (0.05 s). The shared RelayStats
    carried `retried` and p1's 9 s into d2's attempt: d2's own prefill was not taken and p1's
    9 s was fed to d2's prefill fit instead."""
    client = FailoverClient(kv_error="push failed")
    service = service_for((("p1", "prefill"), ("d1", "decode"), ("d2", "decode")), client)
    r = service.router

    async def main():
        # A seed: the decode worker samples the first token, so d1's failure comes before any.
        prepared = await service.prepare(CompletionRequest(model="m", prompt=list(range(2500)), max_tokens=8,
                                                           seed=1, temperature=0.8))
        return await service.serve(prepared, "completions")

    response = asyncio.run(main())
    assert response.status_code == 200
    first_decode = next(c for c in client.calls if c != "p1")
    last = "d2" if first_decode == "d1" else "d1"
    assert client.calls[0] == "p1" and client.calls[-1] == last and response.headers["x-mooncake-prefill"] == last
    fit = r.calibration.instance(last).prefill
    assert fit.samples == 1
    assert fit.scale == pytest.approx((0.05 / r.scheduler.estimators.prefill_s(2500, 0)) ** SHRINK)
    assert r.calibration.instance("p1").prefill.samples == 0
