"""Baseline, early and prediction-based early rejection (paper section 6)."""

import pytest
from core_helpers import decode, prefill, request, scheduler, state

from conductor.core import Decision, DecodeSeq, InstanceState, Rejection, RejectReason, Request, Role

# TBT = 0.01 + 0.001*batch: with a 0.1 s SLO a decode instance takes at most 90 sequences.
SLO = dict(tbt_slo_s=0.1, ttft_slo_s=30.0)


def test_baseline_never_refuses_on_decode_load_but_decode_side_does():
    s = state(prefill("p0"), decode("d0", batch=95))
    sch = scheduler(admission="baseline", **SLO)
    d = sch.schedule(request(1000), s, 0.0)
    assert isinstance(d, Decision)
    assert sch.decode_admits(s.decode[0], 1000) is RejectReason.TBT_SLO
    assert sch.decode_admits(decode("d0", batch=5), 1000) is None
    assert sch.decode_admits(decode("d0", batch=5, cap=1200), 1000) is RejectReason.NO_CAPACITY


def test_early_refuses_on_current_decode_load_with_retry_after():
    # Sequences started at t=0 and decode for t_d = 20 s; the request needs 1 s of prefill.
    s = state(prefill("p0"), decode("d0", batch=95, start=0.0), mean_decode_s=20.0)
    r = scheduler(admission="early", **SLO).schedule(request(1000), s, now=5.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    # Room appears when the running batch drains at t = 20 s; its KV would arrive 1 s after a retry.
    assert r.retry_after_s == pytest.approx(20.0 - 5.0 - 1.0)


def test_early_capacity_rejection_reason():
    s = state(prefill("p0"), decode("d0", batch=2, cap=1100))
    r = scheduler(admission="early", **SLO).schedule(request(1000), s, 0.0)
    assert r.reason is RejectReason.NO_CAPACITY and r.retry_can_help  # fits once the batch drains
    never = scheduler(admission="early", **SLO).schedule(request(2000), s, 0.0)
    assert never.reason is RejectReason.NO_CAPACITY and not never.retry_can_help  # not even on an empty node


def test_a_capacity_refusal_counts_the_requests_kv_headroom_in_its_retry():
    """A less important request must leave priority_headroom of the KV free: one that fits an
    empty instance's whole KV but not what it may take of it is never admitted, and is told so."""
    s = state(prefill("p0"), decode("d0", cap=1100))
    sch = scheduler(admission="early", priority_headroom=0.2, **SLO)
    r = sch.schedule(Request("r", 1000, (), 0.0, priority=1), s, 0.0)
    assert r.reason is RejectReason.NO_CAPACITY and not r.retry_can_help
    busy = state(prefill("p0"), decode("d0", batch=2, kv_each=400, cap=2000, start=0.0), mean_decode_s=20.0)
    r = sch.schedule(Request("r", 1000, (), 0.0, priority=1), busy, 5.0)
    # 800 + 1000 fit in 2000 tokens, not in the 1600 it may take; 400 + 1000 do, once a
    # sequence leaves (t_d = 20 s after its start), which its 1 s prefill must wait for.
    assert r.reason is RejectReason.NO_CAPACITY and r.retry_can_help
    assert r.retry_after_s == pytest.approx(20.0 - 5.0 - 1.0)


def test_prediction_admits_when_the_batch_will_have_drained_by_prefill_end():
    # 95 sequences started at t=0 with t_d = 20 s are gone by t* = 19.5 + 1 s.
    s = state(prefill("p0"), decode("d0", batch=95, start=0.0), mean_decode_s=20.0)
    assert isinstance(scheduler(admission="early", **SLO).schedule(request(1000), s, 19.5), Rejection)
    assert isinstance(scheduler(admission="prediction", decode_forecast="age", **SLO).schedule(request(1000), s, 19.5),
                      Decision)


def test_prediction_refuses_for_work_still_in_prefill_that_early_does_not_see():
    s = state(prefill("p0"), decode("d0", batch=10, incoming=85, start=0.0), mean_decode_s=20.0)
    assert isinstance(scheduler(admission="early", **SLO).schedule(request(1000), s, 1.0), Decision)
    r = scheduler(admission="prediction", **SLO).schedule(request(1000), s, 1.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO


def test_prediction_uses_configured_decode_time_until_measured():
    s = state(prefill("p0"), decode("d0", batch=95, start=0.0))
    sch = scheduler(admission="prediction", default_decode_s=5.0, decode_forecast="age", **SLO)
    assert isinstance(sch.schedule(request(1000), s, 4.5), Decision)
    sch = scheduler(admission="prediction", default_decode_s=50.0, **SLO)
    assert isinstance(sch.schedule(request(1000), s, 4.5), Rejection)


def test_prediction_picks_the_decode_instance_that_will_be_free():
    s = state(prefill("p0"), decode("d0", batch=40, start=0.0), decode("d1", batch=20, start=15.0),
              mean_decode_s=20.0)
    # At t* = 19 + 1 s, d0's sequences are done while d1's run until 35 s.
    assert scheduler(admission="prediction", decode_forecast="age", **SLO).schedule(
        request(1000), s, 19.0).decode_instance == "d0"
    assert scheduler(admission="early", **SLO).schedule(request(1000), s, 19.0).decode_instance == "d1"


def test_fluid_forecast_thins_the_running_batch_by_elapsed_share_of_t_d():
    # 100 running, t_d = 10 s, prefill 1 s: the fluid forecast expects 10 to finish -> 90 + 1 > 90 slots.
    s = state(prefill("p0"), decode("d0", batch=100, start=0.0), mean_decode_s=10.0)
    r = scheduler(admission="prediction", **SLO).schedule(request(1000), s, 100.0)
    assert isinstance(r, Rejection)  # the age form would call them all finished long ago
    assert isinstance(scheduler(admission="prediction", decode_forecast="age", **SLO).schedule(request(1000), s, 100.0),
                      Decision)
    s = state(prefill("p0"), decode("d0", batch=100, start=0.0), mean_decode_s=5.0)
    assert isinstance(scheduler(admission="prediction", **SLO).schedule(request(1000), s, 100.0), Decision)


def test_gate_headroom_keeps_kv_margin_only_for_gating_admissions():
    s = state(prefill("p0"), decode("d0", batch=1, kv_each=1000, cap=2100))
    assert isinstance(scheduler(admission="early", gate_kv_headroom=0.1, **SLO).schedule(request(1000), s, 0.0),
                      Rejection)
    assert isinstance(scheduler(admission="early", **SLO).schedule(request(1000), s, 0.0), Decision)
    assert isinstance(scheduler(admission="baseline", gate_kv_headroom=0.1, **SLO).schedule(request(1000), s, 0.0),
                      Decision)


def test_request_level_forecast_uses_known_remaining_lengths():
    # 100 running at 0.11 s a step; prefill 1 s fits 9 steps. Half have 5 tokens left, so by t*
    # 50 remain (+1 fits under the 90-sequence TBT limit); with lengths unknown and t_d long
    # the fluid forecast keeps all 100 and refuses.
    def inst(left):
        run = tuple(DecodeSeq(0.0, 100, left(i)) for i in range(100))
        return InstanceState("d0", Role.DECODE, running=run)

    short_half = state(prefill("p0"), inst(lambda i: 5 if i % 2 else 10_000), mean_decode_s=1000.0)
    assert short_half.decode[0].lengths_known
    assert isinstance(scheduler(admission="prediction", **SLO).schedule(request(1000), short_half, 0.0), Decision)
    all_long = state(prefill("p0"), inst(lambda i: 10_000), mean_decode_s=1000.0)
    assert isinstance(scheduler(admission="prediction", **SLO).schedule(request(1000), all_long, 0.0), Rejection)
    unknown = state(prefill("p0"), inst(lambda i: None), mean_decode_s=1000.0)
    assert not unknown.decode[0].lengths_known
    assert isinstance(scheduler(admission="prediction", **SLO).schedule(request(1000), unknown, 0.0), Rejection)


def test_max_tokens_caps_how_long_a_sequence_is_forecast_to_stay():
    # 100 running, t_d = 1000 s (the mean is long), step 0.11 s, prefill 1 s. Sequences capped at
    # 4 tokens started at t=0 are surely gone by t* = 1 s (4 steps at twice 0.11 s = 0.88 s): the
    # fluid forecast keeps only the uncapped ones. With the cap at 8 tokens (1.76 s) they stay.
    def inst(cap):
        run = tuple(DecodeSeq(0.0, 100, max_tokens=cap if i % 2 else None) for i in range(100))
        return InstanceState("d0", Role.DECODE, running=run)

    sch = scheduler(admission="prediction", **SLO)
    assert isinstance(sch.schedule(request(1000), state(prefill("p0"), inst(4), mean_decode_s=1000.0), 0.0), Decision)
    assert isinstance(sch.schedule(request(1000), state(prefill("p0"), inst(8), mean_decode_s=1000.0), 0.0), Rejection)
    # Incoming sequences too: 100 arriving at t=0 with 4 tokens each are gone by t*.
    incoming = InstanceState("d0", Role.DECODE, incoming=tuple(DecodeSeq(0.0, 100, max_tokens=4) for _ in range(100)))
    assert isinstance(sch.schedule(request(1000), state(prefill("p0"), incoming, mean_decode_s=1000.0), 0.0), Decision)
    uncapped = InstanceState("d0", Role.DECODE, incoming=tuple(DecodeSeq(0.0, 100) for _ in range(100)))
    assert isinstance(sch.schedule(request(1000), state(prefill("p0"), uncapped, mean_decode_s=1000.0), 0.0),
                      Rejection)


@pytest.mark.parametrize("admission", ["early", "prediction"])
def test_a_one_token_answer_prefilled_elsewhere_is_not_refused_for_the_decode_side(admission):
    """Its one token is the prefill's: no decode batch takes it. It was refused as no_capacity for
    a prompt the decode instance could not hold, or tbt_slo for a full batch."""
    sch = scheduler(admission=admission, **SLO)
    for d in (decode("d0", cap=500), decode("d0", batch=95, start=0.0)):
        s = state(prefill("p0"), d, mean_decode_s=20.0)
        one = Request("r", 1000, tuple(range(100)), 0.0, ends_at_prefill=True)
        assert isinstance(sch.schedule(one, s, 5.0), Decision)
        assert isinstance(sch.schedule(request(1000), s, 5.0), Rejection)  # a longer answer still is
    # Prefilled on the decode instance itself (no prefill instance), its prompt's KV needs the room there.
    alone = scheduler(admission=admission, **SLO).schedule(Request("r", 1000, (), 0.0, ends_at_prefill=True),
                                                          state(decode("d0", cap=500)), 0.0)
    assert isinstance(alone, Rejection) and alone.reason is RejectReason.NO_CAPACITY
