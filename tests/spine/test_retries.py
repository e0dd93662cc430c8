"""Retries before the first token: a failed worker is left out and the request moves on, with its
ledger entries and pending prefix, under the SLOs that admitted it; an engine's own error and a
request that fails on every worker end instead. The same scripted relay and real service as
test_lifecycle.py.
"""

import asyncio

import pytest

from conductor.errors import APIError
from conductor.serving import RETRY_SLO_S
from conductor.workers import EngineFailed, WorkerError
from tests.spine.test_lifecycle import (PROMPT, Client, ScriptedRelay, assert_all_released, drive, make_service,
                                        prepared)


def test_error_before_the_first_token_on_every_prefill_worker_is_503_and_releases():
    async def main():
        relay = ScriptedRelay(list(range(4)), fail_on={"p1", "p2", "d1"})
        service = make_service(relay)
        req = await prepared(service, max_tokens=4)
        with pytest.raises(APIError) as info:
            await service.serve(req, "completions")
        assert info.value.status == 503
        assert len(relay.prefills) >= 2  # retried on the other prefill worker first
        assert_all_released(service, "503", first_token=False)

    asyncio.run(main())


def test_retry_on_another_prefill_worker_moves_the_ledger_entry_and_pending_prefix():
    async def main():
        relay = ScriptedRelay(list(range(5)))
        service = make_service(relay)
        first = service.router.pick("probe", PROMPT, 5, 0.0)  # which instance the core will choose
        service.router.finished(first, 0.0)
        relay.fail_on = {first.prefill.name}
        req = await prepared(service, max_tokens=5, stream=True)
        response = await service.serve(req, "completions")
        other = "p2" if first.prefill.name == "p1" else "p1"
        assert relay.prefills == [first.prefill.name, other]
        # The retry's KV transfer is not the failed attempt's (a late reservation or drop of
        # that one must not touch it).
        assert relay.request_ids == [req.request_id, req.request_id + "-r1"]
        assert response.headers["x-mooncake-prefill"] == other
        snap = service.snapshot()  # mid-request: only the new route holds entries
        assert snap["ledgers"][first.prefill.name] == {"prefill_jobs": 0, "incoming": 0, "running": 0}
        assert snap["ledgers"]["d1"]["running"] == 1 and snap["in_flight"] == 1
        assert service.metrics.value("mooncake_retries_total", stage="prefill") == 1
        await drive(response, Client())
        assert_all_released(service, "200")

    asyncio.run(main())


def test_a_decode_worker_failing_before_the_first_token_is_excluded_not_the_prefill():
    """A grammar's request starts on D (P's token is not used): D failing there, with no other
    decode worker for the relay to try, was blamed on the healthy prefill worker, which was
    excluded and the same D asked again."""
    class FailingDecode(ScriptedRelay):
        decodes: list[str] = []

        async def run(self, request_id, prompt, sampling, route, stats):
            self.decodes.append(route.decode.name)
            if route.decode.name == "d1":
                self.prefills.append(route.prefill.name)
                raise WorkerError("d1: grammar backend crashed", worker="d1")
            async for chunk in super().run(request_id, prompt, sampling, route, stats):
                yield chunk

    async def main():
        relay = FailingDecode(list(range(5)))
        service = make_service(relay, (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")))
        first = service.router.pick("probe", PROMPT, 5, 0.0)
        service.router.finished(first, 0.0)
        if first.decode.name != "d1":
            pytest.skip("the core chose d2 first")
        req = await prepared(service, max_tokens=5, stream=True)
        response = await service.serve(req, "completions")
        assert relay.decodes == ["d1", "d2"] and relay.prefills == ["p1", "p1"]
        assert service.metrics.value("mooncake_retries_total", stage="decode") == 1
        assert service.metrics.value("mooncake_retries_total", stage="prefill") == 0
        await drive(response, Client())
        assert_all_released(service, "200")

    asyncio.run(main())


def test_a_retry_is_not_refused_for_the_slos_that_admitted_the_request():
    """A prefill worker died before the first token: the request, admitted already, goes to
    another worker even where the SLO gate would now refuse it (say, the only other worker is
    decoding near its TBT bound), instead of being lost with a 503."""
    from conductor.serving import RETRY_SLO_S

    async def main():
        relay = ScriptedRelay(list(range(3)))
        service = make_service(relay)
        first = service.router.pick("probe", PROMPT, 3, 0.0)
        service.router.finished(first, 0.0)
        relay.fail_on = {first.prefill.name}
        picks, pick = [], service.router.pick

        def strict_first_pick_only(*args, slo=None, **kwargs):  # the gate refuses any SLO-bound pick now
            picks.append(slo)
            if len(picks) > 1 and slo.ttft_s < RETRY_SLO_S:
                raise APIError(429, "would miss the TTFT SLO", code="ttft_slo", headers={"Retry-After": "1"})
            return pick(*args, slo=slo, **kwargs)

        service.router.pick = strict_first_pick_only
        response = await service.serve(await prepared(service, max_tokens=3), "completions")
        assert response.status_code == 200 and len(relay.prefills) == 2
        assert picks[1].ttft_s == picks[1].tbt_s == RETRY_SLO_S and picks[1].slo_class == picks[0].slo_class
        assert_all_released(service, "200")

    asyncio.run(main())


@pytest.mark.parametrize("priority", [-1, 0, 5])
def test_a_retry_of_a_less_important_request_is_not_capped_below_the_classes_above_it(priority):
    """limits_for holds a request to (1 - priority_headroom) of the SLOs of every class more
    important than it: the retry of an admitted one must escape that too, or be refused after all."""
    from conductor.core import Request, SLOClass, SchedulerConfig
    from conductor.core.admission import limits_for
    from conductor.serving import retry_slo
    from conductor.slo import RequestSLO

    config = SchedulerConfig(ttft_slo_s=30.0, tbt_slo_s=0.5, priority_headroom=0.2,
                             slo_classes=(SLOClass("interactive", 2.0, 0.05, priority=-3),))
    again = retry_slo(RequestSLO("batch", priority, 60.0, 1.0), config)
    assert again.slo_class == "batch" and again.ttft_s == again.tbt_s == RETRY_SLO_S
    limits = limits_for(Request("r", 100, (), 0.0, again.priority, again.ttft_s, again.tbt_s), config)
    assert limits.ttft_s == limits.tbt_s == RETRY_SLO_S and limits.kv_headroom == 0.0


def test_a_request_that_fails_on_every_worker_ends_instead_of_bouncing_between_them():
    """Found live: top_k past int64 made vLLM fail the request on every worker. The relay moved a
    failed decode to the other worker, which failed too, and each retry excluded only a worker
    already excluded: two workers handed the request back and forth for ever (a hung request)."""
    class FailsEverywhere(ScriptedRelay):
        router = p1 = None

        async def run(self, request_id, prompt, sampling, route, stats):
            self.prefills.append(route.prefill.name)
            self.request_ids.append(request_id)
            assert len(self.prefills) <= 10, f"still retried after {self.prefills}"  # (no await: a hang)
            self.p1 = self.p1 or next(w for w in (route.prefill, route.decode) if w.name == "p1")
            if route.decode is not self.p1:  # as the relay: D failed, p1 took it over (on_moved), and failed
                self.router.move_decode(route, self.p1, 0.0)
            raise WorkerError("p1: EngineGenerateError", worker="p1")
            yield  # an async generator, as the relay's

    async def main():
        relay = FailsEverywhere([1])
        service = make_service(relay, (("p1", "prefill"), ("d1", "decode")))
        relay.router = service.router
        req = await prepared(service, max_tokens=4)
        with pytest.raises(APIError) as info:
            await asyncio.wait_for(service.serve(req, "completions"), 5)
        assert info.value.status in (502, 503), info.value
        assert len(relay.prefills) <= 2 and len(set(relay.request_ids)) == len(relay.request_ids)
        assert_all_released(service, str(info.value.status), first_token=False)

    asyncio.run(main())


def test_an_engine_error_before_the_first_token_is_not_retried_on_other_workers():
    async def main():
        relay = ScriptedRelay(list(range(4)), fail_on={"p1", "p2", "d1"}, error=EngineFailed)
        service = make_service(relay)
        req = await prepared(service, max_tokens=4)
        with pytest.raises(APIError) as info:
            await service.serve(req, "completions")
        assert info.value.status == 500
        assert len(relay.prefills) == 1  # the same request would fail the same way elsewhere
        assert_all_released(service, "500", first_token=False)

    asyncio.run(main())
