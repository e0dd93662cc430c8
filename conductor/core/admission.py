"""Decode-side selection and overload admission (paper sections 5 and 6).

Which decode load a decision looks at is the whole difference between the admission
policies:

  none / baseline  select on the committed load (decoding now + already assigned and still
                   in prefill) and never refuse here; under baseline the decode instance
                   itself refuses when the KV arrives (decode_admits), wasting the prefill.
  early            judge the load the decode instances report now (what is decoding), before
                   prefill starts (6.2). It ignores work still in prefill, so it admits too
                   much while the decode pool is emptying and too little while it fills: the
                   anti-phase swings of paper Figure 7.
  prediction       forecast the load at t* = now + predicted TTFT, when this request's KV
                   would arrive, assuming every request decodes for a uniform t_d (6.4):
                   sequences still running at t* plus those assigned and not finished by t*.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.core.config import Admission, SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.types import InstanceState, RejectReason


class LoadView(enum.Enum):
    REPORTED = "reported"
    COMMITTED = "committed"
    FORECAST = "forecast"


def view_for(admission: Admission) -> LoadView:
    if admission is Admission.EARLY:
        return LoadView.REPORTED
    if admission is Admission.PREDICTION:
        return LoadView.FORECAST
    return LoadView.COMMITTED


def decode_load(inst: InstanceState, view: LoadView, t_star: float, t_d: float) -> tuple[int, int]:
    """(batch size, KV tokens) of a decode instance as `view` sees it at time t_star."""
    if view is LoadView.REPORTED:
        return len(inst.running), inst.kv_tokens
    seqs = inst.running + inst.incoming
    if view is LoadView.COMMITTED:
        return len(seqs), sum(s.kv_tokens for s in seqs)
    alive = [s for s in seqs if s.start_s + t_d > t_star]
    return len(alive), sum(s.kv_tokens for s in alive)


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    instance_id: str
    tbt_s: float
    problem: RejectReason | None  # None when it fits within KV capacity and the TBT SLO


def judge_decode(inst: InstanceState, kv_need: int, view: LoadView, t_star: float, t_d: float,
           est: Estimators, cfg: SchedulerConfig) -> DecodeChoice:
    batch, kv = decode_load(inst, view, t_star, t_d)
    tbt = est.tbt_s(batch + 1, kv + kv_need)
    if kv + kv_need > inst.kv_capacity_tokens:
        problem: RejectReason | None = RejectReason.NO_CAPACITY
    elif tbt > cfg.tbt_slo_s:
        problem = RejectReason.TBT_SLO
    else:
        problem = None
    return DecodeChoice(inst.instance_id, tbt, problem)


def choose_decode(pool: Sequence[InstanceState], kv_need: int, view: LoadView, t_star: float,
                  t_d: float, est: Estimators, cfg: SchedulerConfig,
                  rng: random.Random | None = None) -> DecodeChoice:
    """The decode instance with the lowest predicted TBT among those that fit; if none fits,
    the lowest TBT overall, carrying its problem. With rng, a uniformly random instance."""
    if rng is not None:
        return judge_decode(rng.choice(pool), kv_need, view, t_star, t_d, est, cfg)
    best_ok: DecodeChoice | None = None
    best_any: DecodeChoice | None = None
    for inst in pool:
        c = judge_decode(inst, kv_need, view, t_star, t_d, est, cfg)
        if c.problem is None and (best_ok is None or c.tbt_s < best_ok.tbt_s):
            best_ok = c
        # Among misfits, exceeding the TBT SLO beats exceeding KV capacity (which would stall).
        if best_any is None or _misfit_key(c) < _misfit_key(best_any):
            best_any = c
    assert best_any is not None
    return best_ok or best_any


def _misfit_key(c: DecodeChoice) -> tuple[bool, float]:
    return c.problem is RejectReason.NO_CAPACITY, c.tbt_s


def decode_admits(inst: InstanceState, kv_need: int, est: Estimators, cfg: SchedulerConfig) -> RejectReason | None:
    """The decode instance's own check when a prefilled request's KV arrives (baseline's only
    decode-side check, and the last line of defence under early and prediction)."""
    return judge_decode(inst, kv_need, LoadView.REPORTED, 0.0, 1.0, est, cfg).problem


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
            if kv + kv_need <= inst.kv_capacity_tokens and est.tbt_s(batch + 1, kv + kv_need) <= cfg.tbt_slo_s:
                best = min(best, 0.0 if s is None else max(s.start_s + t_d - now, 0.0))
                break
    return best
