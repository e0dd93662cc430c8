"""Each rule of Algorithm 1, the threshold, the SLO gates and conditional disaggregation."""

from dataclasses import replace

import pytest
from core_helpers import BS, EST, decode, prefill, request, scheduler, state

from conductor.core import Decision, PendingPrefixes, PrefixIndex, Rejection, RejectReason, SchedulerConfig


def idx(**held: int) -> PrefixIndex:
    """Instance -> number of leading blocks (0..n-1) it holds."""
    index = PrefixIndex()
    for inst, n in held.items():
        index.apply_stored(inst, range(n))
    return index


def test_cache_aware_takes_lowest_queue_plus_prefill_with_local_prefix():
    # p0: empty queue, no cache -> 1.0 s; p1: 0.5 s queued, 800 cached -> 0.5 + 0.2 = 0.7 s.
    s = state(prefill("p0"), prefill("p1", queued=0.5), decode("d0"), index=idx(p1=80))
    d = scheduler(policy="cache-aware", admission="none").schedule(request(1000), s, now=0.0)
    assert isinstance(d, Decision)
    assert (d.prefill_instance, d.cached_prefix_tokens, d.fetch_from) == ("p1", 800, None)
    assert d.predicted_ttft_s == pytest.approx(0.7)


def test_load_balance_ignores_cache_and_random_is_seeded():
    s = state(prefill("p0"), prefill("p1", queued=0.5), decode("d0"), index=idx(p1=80))
    d = scheduler(policy="load-balance", admission="none").schedule(request(1000), s, 0.0)
    assert d.prefill_instance == "p0"
    picks = [scheduler(policy="random", admission="none", seed=3).schedule(request(1000), s, 0.0).prefill_instance
             for _ in range(2)]
    assert picks[0] == picks[1]


def test_kvcache_centric_fetches_hot_prefix_from_busy_holder():
    # The holder p1 is swamped; p0 is idle and fetches 900 tokens (0.09 s) instead of recomputing them.
    s = state(prefill("p0"), prefill("p1", queued=5.0), decode("d0"), index=idx(p1=90))
    d = scheduler(policy="kvcache-centric", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens, d.fetched_blocks) == ("p0", "p1", 900, 90)
    assert d.predicted_transfer_s == pytest.approx(0.09)
    assert d.predicted_ttft_s == pytest.approx(0.09 + 0.1)


def test_without_remote_fetch_an_instance_is_priced_by_what_it_holds():
    """--no-remote-fetch: p0 would recompute all 1000 tokens (1 s), so the holder wins while its
    queue is shorter than that, and p0 only past it."""
    s = state(prefill("p0"), prefill("p1", queued=0.5), decode("d0"), index=idx(p1=90))
    d = scheduler(policy="kvcache-centric", admission="none", remote_fetch=False).schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens, d.fetched_blocks) == ("p1", None, 900, 0)
    assert d.predicted_ttft_s == pytest.approx(0.5 + 0.1)
    s = state(prefill("p0"), prefill("p1", queued=5.0), decode("d0"), index=idx(p1=90))
    d = scheduler(policy="kvcache-centric", admission="none", remote_fetch=False).schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens) == ("p0", None, 0)


def test_a_holder_that_serves_no_fetches_is_passed_over_for_one_that_does():
    """A live worker whose pool does not serve other nodes is never a fetch_from: p1 holds the
    longest prefix but cannot be fetched from, so p0 fetches d0's shorter one, or, with no holder
    that serves fetches, computes the whole prompt."""
    p1 = replace(prefill("p1", queued=5.0), serves_fetches=False)
    s = state(prefill("p0"), p1, decode("d0"), index=idx(p1=90, d0=60))
    d = scheduler(policy="kvcache-centric", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens, d.fetched_blocks) == ("p0", "d0", 600, 60)
    s = state(prefill("p0"), p1, replace(decode("d0"), serves_fetches=False), index=idx(p1=90, d0=60))
    d = scheduler(policy="kvcache-centric", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens) == ("p0", None, 0)


def test_the_live_scheduler_fetches_by_default():
    from conductor.config import live_scheduler_config
    from mooncake import defaults

    assert live_scheduler_config().remote_fetch is defaults.REMOTE_FETCH is True
    assert live_scheduler_config(remote_fetch=False).remote_fetch is False
    assert SchedulerConfig().remote_fetch is True  # the simulator models fetches


def test_threshold_below_ratio_recomputes_locally():
    # p0 holds 60 blocks, best holder 90: ratio 1.5. Threshold 2 -> p0 recomputes the 30 extra blocks.
    s = state(prefill("p0"), prefill("p1", queued=5.0), decode("d0"), index=idx(p0=60, p1=90))
    local = scheduler(policy="kvcache-centric", admission="none", kvcache_balancing_threshold=2.0)
    d = local.schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens) == ("p0", None, 600)
    fetch = scheduler(policy="kvcache-centric", admission="none", kvcache_balancing_threshold=1.5)
    d = fetch.schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens, d.fetched_blocks) == ("p0", "p1", 900, 30)


def test_congested_sender_makes_fetching_lose():
    # p1's link has 1 GB queued (100 s at 10 MB/s), so fetching its prefix costs more than waiting for it.
    s = state(prefill("p0"), prefill("p1", queued=5.0, pending=1e9), decode("d0"), index=idx(p1=90))
    d = scheduler(policy="kvcache-centric", admission="none", kvcache_balancing_threshold=1.0).schedule(
        request(1000), s, 0.0)
    # Algorithm 1 alone would price p0 with the fetch (100 s) and send it to p1 (5.1 s); p0 computing
    # the whole prompt itself (1 s) beats both, so the fetch is not made.
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens) == ("p0", None, 0)
    assert d.predicted_ttft_s == pytest.approx(1.0)


def pending(**held: int) -> PendingPrefixes:
    """Instance -> number of leading blocks (0..n-1) that a prefill already dispatched there computes."""
    p = PendingPrefixes()
    for inst, n in held.items():
        p.add(inst, range(n))
    return p


@pytest.mark.parametrize("policy", ["cache-aware", "kvcache-centric"])
def test_a_request_queued_behind_a_prefill_of_its_prefix_is_priced_with_that_prefix(policy):
    # p0 has 0.5 s queued, and that work computes this prompt's first 99 blocks. Ignoring that,
    # p0 costs 0.5 + 1.0 s and idle p1 wins with 1.0 s; counting it, p0 costs 0.5 + 0.01 s.
    s = state(prefill("p0", queued=0.5), prefill("p1"), decode("d0"))
    blind = scheduler(policy=policy, admission="none").schedule(request(1000), s, 0.0)
    assert (blind.prefill_instance, blind.cached_prefix_tokens) == ("p1", 0)
    s = state(prefill("p0", queued=0.5), prefill("p1"), decode("d0"), pending=pending(p0=99))
    d = scheduler(policy=policy, admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.cached_prefix_tokens, d.fetch_from) == ("p0", 990, None)
    assert d.predicted_ttft_s == pytest.approx(0.5 + 0.01)


def test_a_pending_prefix_is_never_fetched_from():
    # p0 will hold 90 blocks once its queue drains (5 s), p2 holds 50 now: the idle p1 fetches the
    # stored 50 from p2, not the 90 that do not exist yet on p0.
    s = state(prefill("p0", queued=5.0), prefill("p1"), prefill("p2", queued=5.0), decode("d0"),
              index=idx(p2=50), pending=pending(p0=90))
    d = scheduler(policy="kvcache-centric", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.fetch_from, d.cached_prefix_tokens) == ("p1", "p2", 500)


def test_ttft_slo_rejects_with_retry_after_from_queue_drain():
    s = state(prefill("p0", queued=12.0), prefill("p1", queued=15.0), decode("d0"))
    r = scheduler(policy="cache-aware", admission="baseline", ttft_slo_s=10.0).schedule(request(1000), s, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert r.retry_after_s == pytest.approx(12.0 + 1.0 - 10.0)  # shortest queue must drain by 3 s
    assert r.retry_can_help
    none = scheduler(policy="cache-aware", admission="none", ttft_slo_s=10.0).schedule(request(1000), s, 0.0)
    assert isinstance(none, Decision)


def test_retry_after_is_the_ceiling_when_waiting_cannot_help():
    s = state(prefill("p0"), decode("d0"))
    r = scheduler(admission="early", ttft_slo_s=10.0, max_retry_after_s=120.0).schedule(request(20_000), s, 0.0)
    assert r.reason is RejectReason.TTFT_SLO and r.retry_after_s == 120.0 and not r.retry_can_help and r.unattainable


def test_best_effort_serves_an_unattainable_request_only_when_its_prefill_instance_is_idle():
    # 20,000 tokens take 20 s to prefill: past a 10 s TTFT SLO whatever the load.
    idle = state(prefill("p0"), decode("d0"))
    d = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(request(20_000), idle, 0.0)
    assert isinstance(d, Decision) and d.best_effort and d.predicted_ttft_s == pytest.approx(20.0)
    busy = state(prefill("p0", queued=4.0), prefill("p1", queued=6.0), decode("d0"))
    r = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(request(20_000), busy, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert r.unattainable and r.retry_can_help and r.retry_after_s == pytest.approx(6.0)  # every queue drained
    # One idle instance is not an idle cluster: the long prefill would delay requests that can meet theirs.
    partly = state(prefill("p0", queued=4.0), prefill("p1"), decode("d0"))
    r = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(request(20_000), partly, 0.0)
    assert isinstance(r, Rejection) and r.unattainable and r.retry_after_s == pytest.approx(4.0)  # p0 drains
    # One that asked for a tighter TTFT than the server's is refused: late is no use to it.
    tight = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(
        replace(request(20_000), ttft_slo_s=5.0), idle, 0.0)
    assert isinstance(tight, Rejection) and tight.unattainable
    assert not tight.retry_can_help and tight.retry_after_s == 300.0  # no retry would be served
    # In a cluster without prefill instances, every decode instance may prefill: all must be idle.
    colocated = state(decode("d0", queued=6.0), decode("d1"))
    r = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(
        request(20_000), colocated, 0.0)
    assert isinstance(r, Rejection) and r.unattainable and r.retry_after_s == pytest.approx(6.0)
    # An attainable request is priced as before: neither best effort nor unattainable.
    fits = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(request(1000), idle, 0.0)
    assert isinstance(fits, Decision) and not fits.best_effort
    late = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=True).schedule(
        request(1000), state(prefill("p0", queued=12.0), decode("d0")), 0.0)
    assert isinstance(late, Rejection) and not late.unattainable and late.retry_after_s == pytest.approx(3.0)


@pytest.mark.parametrize("best_effort", [False, True])
def test_a_request_another_instance_meets_once_its_queue_drains_is_not_unattainable(best_effort):
    """The instance chosen now (idle, no prefix) misses the SLO whatever the wait; the one that
    holds most of the prompt meets it once its queue has drained. A retry then helps, and is
    told when."""
    index = PrefixIndex()
    index.apply_stored("p1", range(1900))  # 19,000 of the 20,000 tokens: 1 s of prefill left there
    holder = replace(prefill("p1", queued=45.0), serves_fetches=False)  # nobody fetches them from it
    s = state(holder, prefill("p2"), decode("d0"), index=index)
    r = scheduler(admission="early", ttft_slo_s=10.0, best_effort_when_idle=best_effort).schedule(
        request(20_000), s, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert not r.unattainable and r.retry_can_help
    assert r.retry_after_s == pytest.approx(45.0 + 1.0 - 10.0)  # p1's queue drained enough
    later = state(replace(holder, queued_prefill_s=9.0), prefill("p2"), decode("d0"), index=index)
    d = scheduler(admission="early", ttft_slo_s=10.0).schedule(request(20_000), later, 36.0)
    assert isinstance(d, Decision) and d.prefill_instance == "p1"


def test_other_instances_are_priced_as_they_would_run_and_only_by_a_policy_that_would_choose_them():
    # Two decode instances each decoding 5 sequences (no prefill instance): prefilling 1,000
    # tokens beside a batch takes its chunks and the batch's steps on either, 1.15 s > 1.1 s.
    busy = state(decode("d0", batch=5), decode("d1", batch=5))
    d = scheduler(admission="early", ttft_slo_s=1.1, tbt_slo_s=1.0, chunk_tokens=100,
                  best_effort_when_idle=True).schedule(request(1000), busy, 0.0)
    assert isinstance(d, Decision) and d.best_effort  # unattainable on both: nothing is queued
    # Load-balance picks the shortest queue whatever the prefix: the instance holding it would
    # meet the SLO, but no retry would be sent there, so no retry helps this one.
    index = PrefixIndex()
    index.apply_stored("p1", range(1900))
    s = state(prefill("p0"), replace(prefill("p1"), serves_fetches=False), decode("d0"), index=index)
    d = scheduler(policy="load-balance", admission="early", ttft_slo_s=10.0,
                  best_effort_when_idle=True).schedule(request(20_000), s, 0.0)
    assert isinstance(d, Decision) and d.best_effort and d.prefill_instance == "p0"


def test_decode_choice_lowest_tbt_within_capacity():
    s = state(prefill("p0"), decode("d0", batch=5), decode("d1", batch=1, cap=500), decode("d2", batch=3))
    d = scheduler(admission="early").schedule(request(1000), s, 0.0)
    assert d.decode_instance == "d2"  # d1 has the smallest batch but no KV room
    assert d.predicted_tbt_s == pytest.approx(0.01 + 0.001 * 4)


def test_no_decode_pool_is_no_instance():
    r = scheduler().schedule(request(100), state(prefill("p0")), 0.0)
    assert r.reason is RejectReason.NO_INSTANCE


@pytest.mark.parametrize("policy", ["random", "load-balance", "cache-aware", "kvcache-centric"])
def test_without_a_prefill_pool_every_prompt_is_prefilled_on_a_decode_instance(policy):
    # A colocated cluster: 5,000 new tokens (5 s) is far over the one-step budget and breaks the
    # running batch's 0.1 s TBT for that step, but there is nowhere else to prefill it.
    s = state(decode("d0", batch=10, queued=3.0), decode("d1", batch=2))
    d = scheduler(policy=policy, admission="prediction", tbt_slo_s=0.1, ttft_slo_s=30.0).schedule(request(5000), s, 0.0)
    assert isinstance(d, Decision) and d.colocated
    if policy != "random":  # d1: no queue, so the lowest TTFT and the shortest queue
        assert d.decode_instance == "d1"
        # vLLM runs it in three 2,048-token steps, each also stepping d1's batch (0.012 s).
        assert d.predicted_ttft_s == pytest.approx(5.0 + 3 * (0.01 + 0.002))


def test_colocated_cluster_prefers_the_instance_holding_the_prefix_and_keeps_admission():
    s = state(decode("d0"), decode("d1", queued=1.0), index=idx(d1=400))
    d = scheduler(policy="cache-aware", admission="baseline").schedule(request(5000), s, 0.0)
    assert (d.decode_instance, d.cached_prefix_tokens) == ("d1", 4000)  # 1 + 1 s beats 5 s
    assert d.predicted_ttft_s == pytest.approx(2.0)
    slow = scheduler(policy="cache-aware", admission="baseline", ttft_slo_s=1.0).schedule(request(5000), s, 0.0)
    assert isinstance(slow, Rejection) and slow.reason is RejectReason.TTFT_SLO
    full = state(decode("d0", batch=1, kv_each=900, cap=1000))
    r = scheduler(admission="early").schedule(request(500), full, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.NO_CAPACITY
    assert isinstance(scheduler(admission="baseline").schedule(request(500), full, 0.0), Decision)


def test_colocates_short_prompt_when_it_fits_one_step_and_wins():
    # Prefill pool is 2 s behind; the 50-token prompt costs 0.05 s in one step on d0, whose batch
    # of 10 steps in 0.02 s: 0.07 s <= 0.1 s TBT SLO.
    s = state(prefill("p0", queued=2.0), decode("d0", batch=10))
    sch = scheduler(admission="prediction", conditional_disaggregation=True, tbt_slo_s=0.1)
    d = sch.schedule(request(50), s, 0.0)
    assert d.colocated and d.prefill_instance == d.decode_instance == "d0"
    assert d.predicted_ttft_s == pytest.approx(0.07)


def test_no_colocation_when_the_step_breaks_running_tbt_or_prompt_too_long():
    s = state(prefill("p0", queued=2.0), decode("d0", batch=10))
    sch = scheduler(admission="prediction", conditional_disaggregation=True, tbt_slo_s=0.1)
    assert not sch.schedule(request(90), s, 0.0).colocated  # 0.09 + 0.02 > 0.1
    long_ok = scheduler(admission="prediction", conditional_disaggregation=True, tbt_slo_s=10.0,
                        colocate_max_new_tokens=100)
    assert not long_ok.schedule(request(500), s, 0.0).colocated  # over the one-step token budget
    assert long_ok.schedule(request(100), s, 0.0).colocated


def test_a_decode_instance_with_small_steps_colocates_a_prompt_longer_than_one_step():
    # d0 steps 32 new tokens at a time: the 90-token prompt is three steps of at most
    # 0.032 + 0.02 s, each within the batch's 0.1 s TBT, so it may prefill there, and its first
    # token comes after all three (0.09 + 3 x 0.02 s). Priced as one step (0.11 s) it could not.
    s = state(prefill("p0", queued=2.0), replace(decode("d0", batch=10), chunk_tokens=32))
    d = scheduler(admission="prediction", conditional_disaggregation=True, tbt_slo_s=0.1).schedule(request(90), s, 0.0)
    assert d.colocated and d.decode_instance == "d0"
    assert d.predicted_ttft_s == pytest.approx(0.09 + 3 * 0.02)


def test_colocation_only_when_it_predicts_lower_ttft():
    s = state(prefill("p0"), decode("d0", batch=10))
    sch = scheduler(admission="prediction", conditional_disaggregation=True, tbt_slo_s=0.1)
    d = sch.schedule(request(50), s, 0.0)
    assert not d.colocated and d.prefill_instance == "p0"  # 0.05 s < 0.07 s


@pytest.mark.parametrize("kw", [dict(block_size=0), dict(ttft_slo_s=0), dict(tbt_slo_s=float("inf")),
                                dict(kvcache_balancing_threshold=0.5), dict(policy="fastest"),
                                dict(min_retry_after_s=5, max_retry_after_s=1)])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        SchedulerConfig(**kw)


def test_scheduler_does_not_mutate_state():
    s = state(prefill("p0"), decode("d0", batch=2), index=idx(p0=5))
    before = (s.instances, s.index.match(list(range(5))), len(s.index))
    scheduler().schedule(request(100), s, 0.0)
    assert before == (s.instances, s.index.match(list(range(5))), len(s.index))
    assert BS == 10 and EST.prefill_s(1000, 0) == pytest.approx(1.0)


def test_a_prefix_held_only_in_a_pool_is_priced_by_its_tiers_load():
    """Pool tiers: p0 holds 90 blocks in its engine, p1 the same 90 only on SSD, which must be
    loaded first (900 tokens of 1 KB at the SSD rate); p0 wins, and p1's price includes the load."""
    index = idx(p0=90)
    index.apply_stored("p1", range(90), pool_tiers={b: "ssd" for b in range(90)})
    s = state(prefill("p0"), prefill("p1"), decode("d0"), index=index)
    d = scheduler(policy="cache-aware", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.cached_prefix_tokens) == ("p0", 900)
    assert d.predicted_ttft_s == pytest.approx(0.1)
    s = state(prefill("p0", queued=1.0), prefill("p1"), decode("d0"), index=index)
    d = scheduler(policy="cache-aware", admission="none").schedule(request(1000), s, 0.0)
    assert (d.prefill_instance, d.cached_prefix_tokens) == ("p1", 900)
    assert d.predicted_ttft_s == pytest.approx(0.1 + 900 * 1000 / EST.ssd_load_Bps)
    # DRAM loads faster than SSD.
    index.apply_stored("p1", range(90), pool_tiers={b: "dram" for b in range(90)})
    d = scheduler(policy="kvcache-centric", admission="none").schedule(request(1000), s, 0.0)
    assert d.predicted_ttft_s == pytest.approx(0.1 + 900 * 1000 / EST.dram_load_Bps)


def test_the_live_conductor_prices_a_fetch_with_its_fixed_cost():
    """A fetch of a block or two is not worth its round trip and vLLM's asynchronous load: the
    live estimators charge defaults.FETCH_LATENCY_S, so an idle instance computes 128 tokens
    itself rather than fetch them, and still fetches a prefix worth the wait."""
    from conductor.config import live_estimators, live_scheduler_config
    from conductor.core import Scheduler
    from mooncake import defaults

    est = live_estimators("smollm2-135m-cpu-bf16")
    assert est.transfer_latency_s == defaults.FETCH_LATENCY_S > 0
    sched = Scheduler(live_scheduler_config(admission="none", flexible_roles=False,
                                            conditional_disaggregation=False), est)
    bs = defaults.KV_BLOCK_SIZE
    for held, fetched in ((1, False), (16, True)):  # 128 tokens: ~0.1 s of compute; 2k: seconds
        index = PrefixIndex()
        index.apply_stored("d0", range(held))
        s = state(prefill("p0", bw=2e9), decode("d0"), index=index)
        d = sched.schedule(request(held * bs + 200, n_blocks=held + 1), s, 0.0)
        assert (d.fetch_from == "d0") is fetched, (held, d)
