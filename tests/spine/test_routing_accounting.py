"""The router's bookkeeping for requests whose path is not the plain one (conductor/routing.py):
one-token answers, routes moved off a failed worker, first tokens sampled on the decode worker,
and prompts computed beside a running batch: what the ledger, the decode meter and the
calibration are told of them. Helpers are test_routing's."""

from conductor.routing import Route
from mooncake.hashing import hash_prompt_blocks
from tests.spine.test_routing import BLOCK, pool_of, router


def test_a_one_token_answer_prefilled_elsewhere_is_no_decode_sequence():
    """Its only token comes from the prefill: it never joins the decode batch, as the core admits
    it. It was still counted there as coming (the scheduler then saw phantom sequences on D) and,
    once its token came, as a decode of about 0 s (teaching the decode meter a short t_d)."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    p1, d1 = pool.handles["http://p1"], pool.handles["http://d1"]
    route = r.pick("one", list(range(1000, 3000)), 1, now=0.0, ends_at_prefill=True)
    assert route.prefill is p1 and route.decode is d1
    assert "one" in p1.ledger.prefill_jobs and "one" not in d1.ledger.incoming
    r.first_token(route, now=1.0)
    assert r._decoding == 0 and not d1.ledger.running and "one" not in p1.ledger.prefill_jobs
    r.finished(route, now=1.0)
    assert r.decode_time._count == 0
    # Colocated, its prompt's KV takes the room on the instance: counted as coming, not decoding.
    solo = r._commit(Route(d1, d1, "solo", ends_at_prefill=True), list(range(50)), 1, now=2.0, cached=0,
                     tbt_slo_s=0.5)
    assert "solo" in d1.ledger.incoming
    r.first_token(solo, now=2.5)
    assert r._decoding == 0
    r.finished(solo, now=2.5)
    assert not d1.ledger.running and not d1.ledger.incoming and r.decode_time._count == 0


def test_the_ttft_of_a_route_moved_off_a_failed_worker_teaches_no_prefill_speed():
    """Its TTFT includes the time lost on the failed worker (up to the token timeout): fitted
    against the original prediction, one failover moved the new worker's price 1.85x."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    r = router(pool)
    route = r.pick("req", list(range(1000, 3000)), 16, now=0.0)
    spare = next(h for h in pool.all() if h.role == "decode" and h is not route.decode)
    r.move_decode(route, spare, now=5.0)
    r.first_token(route, now=30.0)
    assert r.calibration.instance(route.prefill.name).ttft_residual.samples == 0


def test_a_prefill_computed_beside_a_running_batch_is_no_calibration_sample():
    """Each of its steps also stepped the batch (the scheduler prices that apart): fitted as a
    bare prefill, such samples taught a scale of 1.94 where the engine ran at its profile's speed."""
    from conductor.relay import RelayStats

    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    d1 = pool.handles["http://d1"]

    def colocated(name, now):
        prompt = list(range(100 * now, 100 * now + 50))
        route = r._commit(Route(d1, d1, name), prompt, 4, now=now, cached=0, tbt_slo_s=0.5)
        r.first_token(route, now=now + 1)
        r.measured(RelayStats(prompt_tokens=50, prefill_instance="d1", prefill_s=0.05, prefill_concurrent=0), route,
                   now=now + 1)
        return route

    alone = colocated("alone", 1)  # nothing else on d1: a sample
    assert r.calibration.instance("d1").prefill.samples == 1
    colocated("beside", 3)  # "alone" is decoding there meanwhile
    assert r.calibration.instance("d1").prefill.samples == 1
    r.finished(alone, now=5)


def test_a_prompt_whose_first_token_comes_from_decode_leaves_the_prefill_queue_when_prefill_ends():
    """A seed, penalties or a grammar: D samples the first token. P's job stayed at the head of
    P's queue until then, counted whole (the ledger's spurious-refusal bug again), and D's start
    was charged to P's TTFT residual."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    p1, d1 = pool.handles["http://p1"], pool.handles["http://d1"]
    route = r.pick("seeded", list(range(1000, 3000)), 16, now=0.0)
    r.prefill_ended(route, now=2.0)
    assert "seeded" not in p1.ledger.prefill_jobs and "seeded" in d1.ledger.incoming
    assert r.pending.match(tuple(hash_prompt_blocks(list(range(1000, 3000)), BLOCK))) == {}
    r.first_token(route, now=6.0)
    assert "seeded" in d1.ledger.running
    assert r.calibration.instance("p1").ttft_residual.samples == 0
    r.finished(route, now=8.0)
    assert not d1.ledger.running and not p1.ledger.prefill_jobs


def test_the_relay_says_when_the_prefill_is_done_and_decode_samples_the_first_token():
    import asyncio

    from conductor.relay import Relay, RelayStats
    from mooncake.protocol import GenerateChunk, Sampling

    class Workers:
        async def generate(self, worker, request):
            if request.sampling.max_tokens == 1:
                yield GenerateChunk([7], finish_reason="length", num_cached_tokens=0)
                return
            yield GenerateChunk([1], num_cached_tokens=0)
            yield GenerateChunk([2], finish_reason="length")

        async def drop_transfer(self, worker, transfer_id):
            """Nothing is pushed in these runs' failures: nothing to drop."""

    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    route = Route(pool.handles["http://p1"], pool.handles["http://d1"], "r")
    prefilled = []

    async def main(sampling):
        relay = Relay(Workers(), 5.0, lambda tried: None, on_prefilled=prefilled.append)
        return [c async for c in relay.run("r", [5] * 300, sampling, route, RelayStats())]

    asyncio.run(main(Sampling(max_tokens=3)))
    assert prefilled == []  # P's token is the first: its first token ends the prefill
    asyncio.run(main(Sampling(max_tokens=3, seed=1, temperature=0.8)))
    assert prefilled == [route]
