"""Per-request SLOs and priority classes in the scheduling core (admission.limits_for), with an
explicit clock and round numbers: 1 ms of prefill per prompt token, TBT = 10 ms + 1 ms per
sequence (core_helpers.EST)."""

import math

import pytest
from core_helpers import decode, prefill, scheduler, state

from conductor.core import Decision, DecodeSeq, InstanceState, Rejection, RejectReason, Request, Role, SLOClass
from conductor.core.admission import Limits, batch_tbt_slo_s, limits_for

SLO = dict(ttft_slo_s=30.0, tbt_slo_s=0.1, priority_headroom=0.2)
INTERACTIVE = SLOClass("interactive", ttft_slo_s=5.0, tbt_slo_s=0.05, priority=-1)


def req(prompt: int = 1000, priority: int = 0, ttft: float | None = None, tbt: float | None = None) -> Request:
    return Request("r", prompt, (), 0.0, priority, ttft, tbt)


def test_limits_are_the_requests_own_slos_capped_below_every_more_important_class():
    cfg = scheduler(**SLO, slo_classes=(INTERACTIVE,)).config
    # The most important class: its own SLOs, the whole KV.
    assert limits_for(req(priority=-1, ttft=5.0, tbt=0.05), cfg) == Limits(5.0, 0.05, 0.0)
    # Default (priority 0): its own SLOs, but at most 80 % of interactive's, and 20 % of KV kept free.
    lim = limits_for(req(), cfg)
    assert (lim.ttft_s, lim.tbt_s, lim.kv_headroom) == pytest.approx((4.0, 0.04, 0.2))
    # A tighter own SLO stays the limit; a looser one does not lift the cap.
    assert limits_for(req(ttft=2.0), cfg).ttft_s == 2.0
    assert limits_for(req(ttft=60.0), cfg).ttft_s == pytest.approx(4.0)
    # Without operator classes, priority 0 is the default class itself: the config's SLOs...
    plain = scheduler(**SLO).config
    assert limits_for(req(), plain) == Limits(30.0, 0.1, 0.0)
    # ...and a less important request keeps 20 % of them free for it.
    lim = limits_for(req(priority=3), plain)
    assert (lim.ttft_s, lim.tbt_s) == pytest.approx((24.0, 0.08))
    # Equal priority protects nothing: each request is held to its own SLOs.
    assert limits_for(req(priority=-1), scheduler(**SLO, slo_classes=(INTERACTIVE,)).config).ttft_s == 30.0


def test_a_request_is_refused_by_its_own_ttft_slo_not_the_configs():
    # 1000 new tokens = 1 s of prefill behind a 2 s queue: 3 s predicted.
    s = state(prefill("p0", queued=2.0), decode("d0"))
    sch = scheduler(**SLO)
    assert isinstance(sch.schedule(req(), s, 0.0), Decision)
    r = sch.schedule(req(ttft=2.5), s, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert r.predicted_ttft_s == pytest.approx(3.0)
    assert r.retry_can_help and r.retry_after_s == pytest.approx(1.0)  # its queue drains 0.5 s... floored to 1 s
    # Its own prefill alone (1 s) breaks a 0.5 s SLO: no wait helps.
    never = sch.schedule(req(ttft=0.5), s, 0.0)
    assert isinstance(never, Rejection) and not never.retry_can_help


def test_as_the_queue_grows_the_less_important_request_is_refused_first():
    """The priority rule in one sweep: the same request, a growing prefill queue. Priority 0 is
    admitted until its TTFT reaches the 30 s SLO; priority 1 only until 80 % of it (24 s), so the
    last 6 s of queue stay for the default class."""
    sch = scheduler(**SLO)

    def last_admitted(priority: int) -> float:
        admitted = [q for q in range(0, 40) if isinstance(
            sch.schedule(req(priority=priority), state(prefill("p0", queued=float(q)), decode("d0")), 0.0), Decision)]
        return max(admitted)

    assert last_admitted(0) == 29  # 29 s queue + 1 s prefill = 30 s
    assert last_admitted(1) == 23  # 23 + 1 = 24 s = 0.8 x 30 s
    assert last_admitted(7) == 23  # every less important level keeps the same share free
    # Its Retry-After is counted to its own limit: 27 s queue + 1 s - 24 s = 4 s.
    r = sch.schedule(req(priority=1), state(prefill("p0", queued=27.0), decode("d0")), 0.0)
    assert isinstance(r, Rejection) and r.retry_after_s == pytest.approx(4.0)


def test_an_operator_class_above_default_holds_default_requests_below_its_slo():
    s = state(prefill("p0", queued=3.5), decode("d0"))  # 4.5 s predicted TTFT
    sch = scheduler(**SLO, slo_classes=(INTERACTIVE,))
    # Interactive (5 s) makes it; default may use only 80 % of interactive's 5 s.
    assert isinstance(sch.schedule(req(priority=-1, ttft=5.0, tbt=0.05), s, 0.0), Decision)
    r = sch.schedule(req(), s, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


def test_decode_gate_keeps_the_requests_tbt_and_the_tightest_of_the_batch_it_joins():
    # 30 running: TBT with one more = 10 + 31 ms = 41 ms.
    busy = decode("d0", batch=30)
    sch = scheduler(admission="early", **SLO)
    assert isinstance(sch.schedule(req(), state(prefill("p0"), busy), 0.0), Decision)
    r = sch.schedule(req(tbt=0.04), state(prefill("p0"), busy), 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    # A running sequence with a 40 ms SLO of its own: nobody joins, however loose their own SLO.
    tight = InstanceState("d0", Role.DECODE, running=(*busy.running[1:], DecodeSeq(0.0, 100, tbt_slo_s=0.04)))
    r = sch.schedule(req(tbt=1.0), state(prefill("p0"), tight), 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    # When every sequence there has a loose SLO, a loose request may take the batch past the config's.
    loose = InstanceState("d0", Role.DECODE, running=tuple(DecodeSeq(0.0, 100, tbt_slo_s=1.0) for _ in range(95)))
    assert isinstance(sch.schedule(req(), state(prefill("p0"), loose), 0.0), Rejection)  # 106 ms > 100 ms
    assert isinstance(sch.schedule(req(tbt=1.0), state(prefill("p0"), loose), 0.0), Decision)


def test_batch_tbt_slo_is_the_tightest_sequence_a_sequence_without_one_having_the_configs():
    cfg = scheduler(**SLO).config
    assert batch_tbt_slo_s(InstanceState("d", Role.DECODE), cfg) == math.inf
    assert batch_tbt_slo_s(decode("d", batch=2), cfg) == 0.1
    mixed = InstanceState("d", Role.DECODE, running=(DecodeSeq(0.0, 1, tbt_slo_s=2.0),),
                          incoming=(DecodeSeq(5.0, 1, tbt_slo_s=0.3),))
    assert batch_tbt_slo_s(mixed, cfg) == 0.3
    assert batch_tbt_slo_s(InstanceState("d", Role.DECODE, running=(*mixed.running, DecodeSeq(0.0, 1))), cfg) == 0.1


def test_less_important_requests_leave_kv_headroom_for_the_more_important():
    # 800 of 2000 KV tokens in use; the request needs 1000: 90 % full after it.
    s = state(prefill("p0"), decode("d0", batch=8, cap=2000))
    sch = scheduler(admission="early", **SLO)
    assert isinstance(sch.schedule(req(), s, 0.0), Decision)
    r = sch.schedule(req(priority=1), s, 0.0)  # may fill 80 % only
    assert isinstance(r, Rejection) and r.reason is RejectReason.NO_CAPACITY


def test_decode_retry_after_counts_until_the_tight_sequence_has_left():
    """A sequence whose own 40 ms TBT SLO blocks every join: room appears when it ends (t_d = 20 s
    after it started), not never."""
    running = (DecodeSeq(0.0, 100, tbt_slo_s=0.04), *(DecodeSeq(10.0, 100) for _ in range(30)))
    s = state(prefill("p0"), InstanceState("d0", Role.DECODE, running=running), mean_decode_s=20.0)
    r = scheduler(admission="early", **SLO).schedule(req(), s, 5.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO and r.retry_can_help
    assert r.retry_after_s == pytest.approx(20.0 - 5.0 - 1.0)  # it ends at 20 s; the new KV arrives 1 s after


def test_flexible_roles_rank_and_admit_by_the_requests_own_ttft():
    # With flexible roles the candidates that meet the request's own TTFT limit win the ranking.
    s = state(prefill("p0", queued=2.0), decode("d0", queued=0.5))
    sch = scheduler(flexible_roles=True, role_cost_s=0.0, **SLO)
    d = sch.schedule(req(ttft=1.8), s, 0.0)
    assert isinstance(d, Decision) and d.prefill_instance == "d0" and d.predicted_ttft_s == pytest.approx(1.5)
    r = sch.schedule(req(ttft=1.2), s, 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


def test_config_refuses_bad_classes_and_headroom():
    with pytest.raises(ValueError, match="priority_headroom"):
        scheduler(priority_headroom=1.0)
    with pytest.raises(ValueError, match="unique"):
        scheduler(slo_classes=(INTERACTIVE, INTERACTIVE))
    with pytest.raises(ValueError, match="default"):
        scheduler(slo_classes=(SLOClass("default", 1.0, 0.1),))
    with pytest.raises(ValueError, match="tbt_slo_s"):
        SLOClass("x", 1.0, 0.0)
