"""Decode-side selection and overload admission (paper sections 5 and 6).

Which decode load a decision looks at is the whole difference between the admission
policies. Every policy ranks decode instances by the predicted TBT of the load it believes
they will carry, and refuses (or not) by a gate:

  none / baseline  rank and gate on the committed load (decoding now + already assigned and
                   still in prefill); never refuse here. Under baseline the decode instance
                   itself refuses when the KV arrives (decode_admits), wasting the prefill.
  early            rank on the committed load, but gate on the load the decode instances
                   report now (what is decoding), before prefill starts (6.2). The gate ignores
                   work still in prefill, so it admits too much while the decode pool fills and
                   too little while it empties: the anti-phase swings of paper Figure 7.
  prediction       rank and gate on the load forecast for t* = now + predicted TTFT, when this
                   request's KV would arrive, assuming every request decodes for a uniform t_d
                   (6.4): sequences still running at t* plus those assigned and not done by t*.
                   When the shell knows every sequence's remaining length (lengths_known), the
                   forecast is per request instead (6.4's "request-level prediction").
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.core.config import Admission, SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.types import InstanceState, RejectReason, Role


class LoadView(enum.Enum):
    REPORTED = "reported"
    COMMITTED = "committed"
    FORECAST = "forecast"


def views_for(admission: Admission) -> tuple[LoadView, LoadView]:
    """(rank view, gate view) of an admission policy."""
    if admission is Admission.EARLY:
        return LoadView.COMMITTED, LoadView.REPORTED
    if admission is Admission.PREDICTION:
        return LoadView.FORECAST, LoadView.FORECAST
    return LoadView.COMMITTED, LoadView.COMMITTED


@dataclass(frozen=True, slots=True)
class Horizon:
    """now; t_star, the time the request's KV is predicted to reach decode; t_d, the uniform
    decode duration; fluid selects the forecast of running sequences (see decode_load)."""

    now: float
    t_star: float
    t_d: float
    fluid: bool = True


def decode_load(inst: InstanceState, view: LoadView, h: Horizon, est: Estimators) -> tuple[float, float]:
    """(batch size, KV tokens) of a decode instance as `view` sees it at time h.t_star.

    FORECAST, "age" form (paper 6.4 as written): a sequence is gone at t* if it started more
    than t_d before. "fluid" form (default): a sequence running now survives to t* with weight
    1 - (t* - now)/t_d, i.e. the instance completes batch*(t*-now)/t_d sequences by t*
    (Little's law with mean decode time t_d). The age form misjudges heavy-tailed outputs:
    the running population is length-biased, so many sequences already older than t_d keep
    running, and it forecasts room that is not there. Both add the KV the survivors generate
    until t* at the current step time; incoming sequences use the age rule from their arrival.
    """
    if view is LoadView.REPORTED:
        return len(inst.running), inst.kv_tokens
    if view is LoadView.COMMITTED:
        return len(inst.running) + len(inst.incoming), inst.kv_tokens + inst.incoming_kv_tokens
    dt = max(h.t_star - h.now, 0.0)
    step = est.tbt_s(max(len(inst.running), 1), inst.kv_tokens, inst.decode_scale)
    if inst.lengths_known:
        return _request_level(inst, h, dt, step)
    batch = kv = 0.0
    if h.fluid:
        w = max(1.0 - dt / h.t_d, 0.0)
        batch += w * len(inst.running)
        kv += w * (inst.kv_tokens + len(inst.running) * dt / step)
    else:
        for s in inst.running:
            if s.start_s + h.t_d > h.t_star:
                batch += 1
                kv += s.kv_tokens + dt / step
    for s in inst.incoming:
        if s.start_s + h.t_d > h.t_star:
            batch += 1
            kv += s.kv_tokens + max(h.t_star - s.start_s, 0.0) / step
    return batch, kv


def _request_level(inst: InstanceState, h: Horizon, dt: float, step: float) -> tuple[float, float]:
    """Forecast from known remaining lengths at the current step time: a running sequence is
    still there at t* if it has more tokens left than steps fit in dt; an incoming one if it
    has not finished t* - arrival seconds after arriving. Survivors carry the KV they grew."""
    batch = kv = 0.0
    steps = dt / step
    for s in inst.running:
        if s.remaining_tokens > steps:  # type: ignore[operator]  # lengths_known
            batch += 1
            kv += s.kv_tokens + steps
    for s in inst.incoming:
        grown = max(h.t_star - s.start_s, 0.0) / step
        if s.remaining_tokens > grown:  # type: ignore[operator]
            batch += 1
            kv += s.kv_tokens + grown
    return batch, kv


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    instance_id: str
    tbt_s: float
    problem: RejectReason | None  # None when it fits within KV capacity and the TBT SLO


def judge_decode(inst: InstanceState, kv_need: int, view: LoadView, h: Horizon, est: Estimators,
                 cfg: SchedulerConfig, headroom: float = 0.0) -> DecodeChoice:
    return DecodeChoice(inst.instance_id, *_judge(inst, kv_need, view, h, est, cfg, headroom))


def _judge(inst: InstanceState, kv_need: int, view: LoadView, h: Horizon, est: Estimators,
           cfg: SchedulerConfig, headroom: float) -> tuple[float, RejectReason | None]:
    batch, kv = decode_load(inst, view, h, est)
    tbt = est.tbt_s(batch + 1, kv + kv_need, inst.decode_scale)
    if kv + kv_need > inst.kv_capacity_tokens * (1.0 - headroom):
        return tbt, RejectReason.NO_CAPACITY
    if tbt > cfg.tbt_slo_s:
        return tbt, RejectReason.TBT_SLO
    return tbt, None


def rank_and_gate(inst: InstanceState, kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                  est: Estimators, cfg: SchedulerConfig) -> DecodeChoice:
    """TBT under the rank view; problem under the gate view (with the gate's KV headroom)."""
    return DecodeChoice(inst.instance_id, *_rank_and_gate(inst, kv_need, views, h, est, cfg))


def _rank_and_gate(inst: InstanceState, kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                   est: Estimators, cfg: SchedulerConfig) -> tuple[float, RejectReason | None]:
    tbt, problem = _judge(inst, kv_need, views[0], h, est, cfg, 0.0)
    gating = cfg.admission in (Admission.EARLY, Admission.PREDICTION)
    headroom = cfg.gate_kv_headroom if gating else 0.0
    if views[1] is views[0] and headroom == 0.0:
        return tbt, problem
    return tbt, _judge(inst, kv_need, views[1], h, est, cfg, headroom)[1]


def choose_decode(pool: Sequence[InstanceState], kv_need: int, views: tuple[LoadView, LoadView], h: Horizon, est: Estimators, cfg: SchedulerConfig,
                  rng: random.Random | None = None) -> DecodeChoice:
    """Among instances that pass the gate view, the one with the lowest TBT under the rank
    view; if none passes, the lowest TBT overall, carrying its problem. With rng, a uniformly
    random instance."""
    if rng is not None:
        return rank_and_gate(rng.choice(pool), kv_need, views, h, est, cfg)
    # Plain tuples in the loop, one DecodeChoice at the end: at 1,024 instances this loop is
    # half of a decision.
    best_ok: tuple[float, InstanceState] | None = None
    best_any: tuple[bool, float, InstanceState, RejectReason | None] | None = None
    for inst in pool:
        tbt, problem = _rank_and_gate(inst, kv_need, views, h, est, cfg)
        if problem is None:
            if best_ok is None or tbt < best_ok[0]:
                best_ok = (tbt, inst)
        # Among misfits, exceeding the TBT SLO beats exceeding KV capacity (which would stall).
        elif best_ok is None:
            over_kv = problem is RejectReason.NO_CAPACITY
            if best_any is None or (over_kv, tbt) < best_any[:2]:
                best_any = (over_kv, tbt, inst, problem)
    if best_ok is not None:
        return DecodeChoice(best_ok[1].instance_id, best_ok[0], None)
    assert best_any is not None
    return DecodeChoice(best_any[2].instance_id, best_any[1], best_any[3])


def choose_decode_flexible(pool: Sequence[InstanceState], kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                           est: Estimators, cfg: SchedulerConfig, exclude: str) -> tuple[DecodeChoice, float] | None:
    """Flexible roles: the decode instance for a prefill done on `exclude`, among every other
    instance, and its role cost (cfg.role_cost_s for a prefill-labelled one). Order: passes
    the gate, then (among misfits) over the TBT SLO before over KV capacity, then the lower
    role cost (it adds to the pair's TTFT + cost), then the lower TBT. None if no other instance."""
    best: tuple[tuple[bool, bool, float, float], InstanceState, RejectReason | None] | None = None
    for inst in pool:
        if inst.instance_id == exclude:
            continue
        tbt, problem = _rank_and_gate(inst, kv_need, views, h, est, cfg)
        key = (problem is not None, problem is RejectReason.NO_CAPACITY,
               cfg.role_cost_s if inst.role is Role.PREFILL else 0.0, tbt)
        if best is None or key < best[0]:
            best = (key, inst, problem)
    if best is None:
        return None
    key, inst, problem = best
    return DecodeChoice(inst.instance_id, key[3], problem), key[2]


def decode_admits(inst: InstanceState, kv_need: int, est: Estimators, cfg: SchedulerConfig) -> RejectReason | None:
    """The decode instance's own check when a prefilled request's KV arrives (baseline's only
    decode-side check, and the last line of defence under early and prediction)."""
    return judge_decode(inst, kv_need, LoadView.REPORTED, Horizon(0.0, 0.0, 1.0), est, cfg).problem


def decode_drain_s(pool: Sequence[InstanceState], kv_need: int, now: float, t_d: float,
                   est: Estimators, cfg: SchedulerConfig) -> float:
    """Seconds until some decode instance would take kv_need more tokens within the TBT SLO,
    if sequences end t_d after they start and nothing new arrives. inf if never."""
    best = float("inf")
    for inst in pool:
        seqs = sorted(inst.running + inst.incoming, key=lambda s: s.start_s)
        batch, kv = len(seqs), sum(s.kv_tokens for s in seqs)
        for s in [None, *seqs]:
            if s is not None:
                batch, kv = batch - 1, kv - s.kv_tokens
            tbt = est.tbt_s(batch + 1, kv + kv_need, inst.decode_scale)
            if kv + kv_need <= inst.kv_capacity_tokens and tbt <= cfg.tbt_slo_s:
                best = min(best, 0.0 if s is None else max(s.start_s + t_d - now, 0.0))
                break
    return best
