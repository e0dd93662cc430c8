"""Goodput and SLO outcomes (conductor/metrics.py, counted by RequestLife and at admission).

A real CompletionService and Router with a scripted relay that moves a fake clock, so each
request's TTFT and mean TBT are known exactly and its outcome can be checked."""

import asyncio

import pytest

from conductor.config import ConductorConfig
from conductor.errors import APIError
from conductor.metrics import SLO_OUTCOMES, ConductorMetrics, slo_outcome
from conductor.schemas import CompletionRequest
from conductor.serving import CompletionService
from conductor.workers import WorkerError
from mooncake.defaults import DEFAULT_SLO_CLASS
from mooncake.protocol import GenerateChunk
from tests.spine.test_lifecycle import Client, LetterTokenizer, drive
from tests.spine.test_routing import pool_of, router

TTFT_SLO, TBT_SLO = 2.0, 0.5
PROMPT = list(range(1000, 1300))  # short enough that the core admits it within a 2 s TTFT SLO


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TimedRelay:
    """Yields `tokens` chunks of one token; the first after `ttft` seconds of the clock, each
    next one `tbt` seconds later; fails after `error_after` chunks if set."""

    def __init__(self, clock: Clock, tokens: int, ttft: float, tbt: float, error_after: int | None = None):
        self.clock, self.tokens, self.ttft, self.tbt, self.error_after = clock, tokens, ttft, tbt, error_after

    async def run(self, request_id, prompt, sampling, route, stats):
        for i in range(self.tokens):
            if i == self.error_after:
                raise WorkerError("decode worker died", started=True)
            self.clock.now += self.ttft if i == 0 else self.tbt
            yield GenerateChunk([i], finish_reason="length" if i == self.tokens - 1 else None)


def service_with(relay: TimedRelay, specs=(("p1", "prefill"), ("d1", "decode"))) -> CompletionService:
    r = router(pool_of(*specs), ttft=TTFT_SLO, tbt=TBT_SLO)
    config = ConductorConfig(model_path="unused", served_model_name="m")
    return CompletionService(config, LetterTokenizer(), r, relay, r.metrics, clock=relay.clock)


async def prepared(service: CompletionService, **body):
    return await service.prepare(CompletionRequest(model="m", prompt=PROMPT, **body))


def outcomes(m: ConductorMetrics) -> dict[str, float]:
    counts = {o: m.value("mooncake_slo_requests_total", slo_class=DEFAULT_SLO_CLASS, outcome=o) for o in SLO_OUTCOMES}
    return {o: n for o, n in counts.items() if n}


async def serve(service: CompletionService, stream: bool, tokens: int):
    req = await prepared(service, max_tokens=tokens, stream=stream)
    response = await service.serve(req, "completions")
    if stream:
        await drive(response, Client())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ttft,tbt,want", [(1.0, 0.2, "met"), (3.0, 0.2, "missed_ttft"), (1.0, 0.8, "missed_tbt"),
                                           (2.0, 0.5, "met")])  # exactly at the SLO meets it
def test_an_answered_request_is_judged_by_its_ttft_and_mean_tbt(stream, ttft, tbt, want):
    relay = TimedRelay(Clock(), tokens=6, ttft=ttft, tbt=tbt)
    service = service_with(relay)
    asyncio.run(serve(service, stream, 6))
    m = service.metrics
    assert outcomes(m) == {want: 1}
    assert m.value("mooncake_goodput_requests_total", slo_class=DEFAULT_SLO_CLASS) == (1 if want == "met" else 0)
    assert m.value("mooncake_schedule_seconds_count") == 1


def test_one_slow_gap_within_a_fast_mean_still_meets_the_tbt_slo():
    """The TBT SLO is on the mean gap (as the scheduler admits by it), not on each gap."""
    clock = Clock()

    class OneStall(TimedRelay):
        async def run(self, request_id, prompt, sampling, route, stats):
            for i, step in enumerate([1.0, 0.1, 0.1, 1.2, 0.1, 0.1]):  # mean gap 0.32 s, one of 1.2 s
                clock.now += step
                yield GenerateChunk([i], finish_reason="length" if i == 5 else None)

    service = service_with(OneStall(clock, 6, 0, 0))
    asyncio.run(serve(service, False, 6))
    assert outcomes(service.metrics) == {"met": 1}


def test_a_failure_after_admission_is_failed_and_a_refusal_is_refused():
    relay = TimedRelay(Clock(), tokens=6, ttft=0.5, tbt=0.1, error_after=3)
    service = service_with(relay)
    with pytest.raises(APIError):
        asyncio.run(serve(service, False, 6))
    refusing = service_with(relay, specs=(("p1", "prefill"),))  # no decode-capable worker: 503
    with pytest.raises(APIError) as info:
        asyncio.run(serve(refusing, False, 6))
    assert info.value.status == 503
    assert outcomes(service.metrics) == {"failed": 1}
    assert outcomes(refusing.metrics) == {"refused": 1}
    assert refusing.metrics.value("mooncake_schedule_seconds_count") == 1  # a refusal is scheduling work too
    assert refusing.metrics.value("mooncake_goodput_requests_total", slo_class=DEFAULT_SLO_CLASS) == 0


def test_a_client_that_leaves_is_cancelled_not_judged():
    relay = TimedRelay(Clock(), tokens=50, ttft=0.5, tbt=0.1)
    service = service_with(relay)

    async def main():
        req = await prepared(service, max_tokens=50, stream=True)
        response = await service.serve(req, "completions")
        await drive(response, Client(leave_after_bodies=3))

    asyncio.run(main())
    assert outcomes(service.metrics) == {"cancelled": 1}


def test_every_outcome_series_exists_at_zero_before_any_request():
    text = ConductorMetrics().render().decode()
    for outcome in SLO_OUTCOMES:
        assert f'mooncake_slo_requests_total{{outcome="{outcome}",slo_class="default"}} 0.0' in text
    assert 'mooncake_goodput_requests_total{slo_class="default"} 0.0' in text
    # Every refusal reason too (the alert on refusals takes a rate over them).
    for reason in ("ttft_slo", "tbt_slo", "no_capacity", "no_instance", "max_in_flight"):
        assert f'mooncake_rejections_total{{reason="{reason}",slo_class="default"}} 0.0' in text


@pytest.mark.parametrize("status,ttft,tbt,want", [
    (None, 0.1, 0.1, "cancelled"), ("502", 0.1, 0.1, "failed"), ("200", None, None, "failed"),
    ("200", 2.01, 0.1, "missed_ttft"), ("200", 3.0, 0.9, "missed_ttft"), ("200", 1.0, 0.51, "missed_tbt"),
    ("200", 1.0, None, "met"), ("200", 2.0, 0.5, "met")])
def test_slo_outcome(status, ttft, tbt, want):
    assert slo_outcome(status, ttft, tbt, TTFT_SLO, TBT_SLO) == want


def test_a_request_is_judged_by_its_own_slo():
    """The same pace misses the default TBT SLO (0.5 s) and meets a request's own 1 s one."""
    clock = Clock()
    service = service_with(TimedRelay(clock, tokens=6, ttft=1.0, tbt=0.8))

    async def main():
        for headers in ({}, {"X-Mooncake-SLO-TBT-Ms": "1000"}):
            req = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=6), headers)
            await service.serve(req, "completions")

    asyncio.run(main())
    assert outcomes(service.metrics) == {"met": 1, "missed_tbt": 1}
