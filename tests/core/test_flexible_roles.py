"""Flexible roles: any instance may prefill or decode; labels only cost role_cost_s."""

from dataclasses import replace

import pytest

from conductor.core import DecodeSeq, Decision, InstanceState, Rejection, RejectReason, Role, SchedulerConfig

from tests.core.core_helpers import decode, prefill, request, scheduler, state


def flex(**kw):
    kw.setdefault("flexible_roles", True)
    kw.setdefault("tbt_slo_s", 0.1)
    kw.setdefault("ttft_slo_s", 30.0)
    return scheduler(**kw)


def test_idle_prefill_instance_serves_whole_when_decode_is_busy():
    # d0's batch of 90 steps at 0.1 s; one more breaks the 0.1 s TBT SLO.
    st = state(prefill("p0"), decode("d0", batch=90))
    fixed = scheduler(admission="early", tbt_slo_s=0.1).schedule(request(100), st, now=0.0)
    assert isinstance(fixed, Rejection) and fixed.reason is RejectReason.TBT_SLO
    d = flex(admission="early").schedule(request(100), st, now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == d.decode_instance == "p0"
    assert d.predicted_ttft_s == pytest.approx(0.1)


def test_long_prompt_goes_to_decode_instance_in_chunks_when_prefill_queue_is_long():
    st = state(prefill("p0", queued=20.0), decode("d0", batch=5))
    # 500 new tokens in chunks of 50: 10 steps of 0.05 s prefill + the batch's 0.015 s step,
    # each 0.065 s within the 0.1 s TBT SLO; beyond the one-step budget (40), so it pays the cost.
    d = flex(admission="early", chunk_tokens=50, colocate_max_new_tokens=40).schedule(request(500), st, now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == d.decode_instance == "d0"
    assert d.predicted_ttft_s == pytest.approx(10 * 0.065)


def test_chunk_step_that_breaks_the_running_batch_tbt_is_not_taken():
    st = state(prefill("p0", queued=20.0), decode("d0", batch=5))
    # Chunks of 100: each step 0.1 + 0.015 s > the 0.1 s SLO, so d0 may not prefill it.
    d = flex(admission="early", chunk_tokens=100).schedule(request(500), st, now=0.0)
    assert isinstance(d, Decision) and (d.prefill_instance, d.decode_instance) == ("p0", "d0")
    r = flex(admission="early", chunk_tokens=100, ttft_slo_s=10.0).schedule(request(500), st, now=0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


def test_an_instance_prices_its_own_chunk_size():
    # The config's chunk (100) breaks the 0.1 s TBT SLO beside d0's batch; d0's own engine steps
    # 50 tokens (its registration says so), which keep it: d0 may prefill while it decodes.
    busy_p = prefill("p0", queued=20.0)
    own = state(busy_p, replace(decode("d0", batch=5), chunk_tokens=50))
    d = flex(admission="early", chunk_tokens=100, colocate_max_new_tokens=40).schedule(request(500), own, now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == d.decode_instance == "d0"
    assert d.predicted_ttft_s == pytest.approx(10 * 0.065)
    # ... and the other way round: the config's 50 would fit, d0's own 100 does not.
    big = state(busy_p, replace(decode("d0", batch=5), chunk_tokens=100))
    d = flex(admission="early", chunk_tokens=50).schedule(request(500), big, now=0.0)
    assert isinstance(d, Decision) and (d.prefill_instance, d.decode_instance) == ("p0", "d0")
    # A step size that cannot be (a malformed worker's) is the config's, never an endless pricing.
    for bad in (-1, -100):
        odd = state(busy_p, replace(decode("d0", batch=5), chunk_tokens=bad))
        d = flex(admission="early", chunk_tokens=50, colocate_max_new_tokens=40).schedule(request(500), odd, now=0.0)
        assert isinstance(d, Decision) and d.predicted_ttft_s == pytest.approx(10 * 0.065)


def test_a_worker_saying_a_negative_step_size_is_not_healthy():
    import msgspec

    from mooncake.protocol import HEALTH_DECODER

    assert HEALTH_DECODER.decode(b'{"chunk_tokens": 256}').chunk_tokens == 256
    with pytest.raises(msgspec.ValidationError):  # WorkerClient.check: a ValueError, the worker is not ready
        HEALTH_DECODER.decode(b'{"chunk_tokens": -1}')


def test_role_cost_breaks_near_ties_toward_labels():
    # p0's queue makes the labelled pair 0.05 s slower than prefilling on the idle d0 itself
    # (beyond the budget: conditional disaggregation is off in these helpers).
    st = state(prefill("p0", queued=0.05), decode("d0"))
    labelled = flex(role_cost_s=0.3).schedule(request(100), st, now=0.0)
    assert (labelled.prefill_instance, labelled.decode_instance) == ("p0", "d0")
    assert labelled.predicted_ttft_s == pytest.approx(0.15)
    free = flex(role_cost_s=0.0).schedule(request(100), st, now=0.0)
    assert free.prefill_instance == "d0" and free.predicted_ttft_s == pytest.approx(0.1)
    # A real imbalance (a queue of seconds) outweighs the cost.
    busy = state(prefill("p0", queued=2.0), decode("d0"))
    moved = flex(role_cost_s=0.3).schedule(request(100), busy, now=0.0)
    assert moved.prefill_instance == moved.decode_instance == "d0"  # within labels' cost: no decode on p0


def test_cluster_of_prefill_instances_only_serves():
    st = state(prefill("p0"), prefill("p1", queued=5.0))
    r = scheduler().schedule(request(100), st, now=0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.NO_INSTANCE
    d = flex().schedule(request(100), st, now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == "p0" and d.decode_instance in ("p0", "p1")


def test_decode_pair_between_decode_instances_when_prefill_pool_is_swamped():
    # d0 is idle but full of KV for decoding; d1 can decode; p0's queue is long.
    st = state(prefill("p0", queued=20.0), decode("d0", cap=50), decode("d1"))
    d = flex(admission="early").schedule(request(100), st, now=0.0)
    assert isinstance(d, Decision) and (d.prefill_instance, d.decode_instance) == ("d0", "d1")


def test_flexible_roles_need_kvcache_centric():
    with pytest.raises(ValueError, match="kvcache-centric"):
        SchedulerConfig(flexible_roles=True, policy="random")


def coming(iid: str, arrives_s: float, max_tokens: int | None = None) -> InstanceState:
    """A decode-labelled instance with nothing decoding yet but a sequence on its way."""
    return InstanceState(iid, Role.DECODE, incoming=(DecodeSeq(arrives_s, 100, max_tokens=max_tokens),))


def test_a_prefill_step_that_would_stall_a_sequence_coming_to_an_instance_is_not_put_there():
    # d0 decodes nothing yet, but a sequence arrives at 0.2 s: a 500-token prompt there (one
    # step of 0.5 s) would sit between two of its tokens, past the 0.1 s TBT SLO. Before, only a
    # running batch was protected, and the live cluster stalled such sequences for seconds.
    d = flex(admission="early").schedule(request(500), state(prefill("p0", queued=20.0), coming("d0", 0.2)), now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == "p0"


def test_a_sequence_that_arrives_after_the_prompt_is_done_does_not_stop_it():
    d = flex(admission="early").schedule(request(500), state(prefill("p0", queued=20.0), coming("d0", 5.0)), now=0.0)
    assert isinstance(d, Decision) and d.prefill_instance == "d0"
    # Arrival times are absolute: at 100 s, one arriving at 100.2 s is stalled.
    late = flex(admission="early").schedule(request(500), state(prefill("p0", queued=20.0), coming("d0", 100.2)),
                                            now=100.0)
    assert late.prefill_instance == "p0"


def test_a_coming_sequence_long_enough_absorbs_the_stall_within_its_mean_tbt():
    # It arrives at 0.2 s and sits through the prompt's last 0.3 s (one 0.5 s step, past the
    # 0.1 s SLO). Its mean gap at 0.011 s steps: over 2000 tokens 0.011 s; over 5 tokens
    # 0.011 + 0.3 / 4 = 0.086 s, within the SLO; over 3 tokens 0.011 + 0.3 / 2 = 0.161 s, not.
    st = lambda n: state(prefill("p0", queued=20.0), coming("d0", 0.2, n))  # noqa: E731
    assert flex(admission="early").schedule(request(500), st(2000), now=0.0).prefill_instance == "d0"
    assert flex(admission="early").schedule(request(500), st(5), now=0.0).prefill_instance == "d0"
    assert flex(admission="early").schedule(request(500), st(3), now=0.0).prefill_instance == "p0"
