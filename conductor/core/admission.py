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

What a gate holds a request to (limits_for) is its own: its TTFT and TBT SLOs, and, when the
operator has SLO classes more important than it (a lower priority number), a share
(priority_headroom) of those classes' SLOs and of each instance's KV capacity left free for
them. So as load rises the less important requests are refused first, at a lower threshold,
and the important ones find the room they need. A decode instance also never takes a request
that would push its batch past the tightest TBT SLO of the sequences it already carries
(batch_tbt_slo_s): a request with a loose TBT SLO cannot break a tight one's.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.core.config import Admission, SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.types import DecodeSeq, InstanceState, RejectReason, Request, Role


@dataclass(frozen=True, slots=True)
class Limits:
    """What admitting one request must keep (limits_for): its predicted TTFT within ttft_s, the
    predicted TBT of the decode batch it joins within tbt_s (and within that batch's own
    batch_tbt_slo_s), its KV within each decode instance's capacity less the share kv_headroom
    (applied by the early and prediction gates)."""

    ttft_s: float
    tbt_s: float
    kv_headroom: float


def limits_for(request: Request, cfg: SchedulerConfig) -> Limits:
    """The request's own SLOs (the config's where it has none), each also capped at
    (1 - priority_headroom) of the tightest SLO of the classes more important than it: the
    operator's slo_classes, and the config's own SLOs, the default class, at priority 0. Its KV
    headroom is the gate's, plus priority_headroom of the rest when there is such a class.

    Why the cap: a prefill queue is first come, first served, and a decode batch's step slows
    every sequence in it; so a less important request admitted up to the very SLO of a more
    important class would leave that class no room. Capped, the less important requests are
    refused first as load rises, and a share of each limit stays for the more important ones."""
    ttft = cfg.ttft_slo_s if request.ttft_slo_s is None else request.ttft_slo_s
    tbt = cfg.tbt_slo_s if request.tbt_slo_s is None else request.tbt_slo_s
    above = [(c.ttft_slo_s, c.tbt_slo_s) for c in cfg.slo_classes if c.priority < request.priority]
    if request.priority > 0:
        above.append((cfg.ttft_slo_s, cfg.tbt_slo_s))
    if not above:
        return Limits(ttft, tbt, cfg.gate_kv_headroom)
    keep = 1.0 - cfg.priority_headroom
    return Limits(min(ttft, keep * min(t for t, _ in above)), min(tbt, keep * min(t for _, t in above)),
                  1.0 - (1.0 - cfg.gate_kv_headroom) * keep)


def seq_tbt_slo_s(seq: DecodeSeq, cfg: SchedulerConfig) -> float:
    """The TBT SLO a decoding sequence is held to: its request's own, else the config's."""
    return cfg.tbt_slo_s if seq.tbt_slo_s is None else seq.tbt_slo_s


def stall_keeps_tbt(step_s: float, longest_s: float, stall_s: float, tokens: int | None, tbt_slo_s: float) -> bool:
    """Whether a sequence that decodes on an instance while it computes `stall_s` seconds of
    prefill (in steps of at most `longest_s`: a chunk and a decode step) keeps its TBT SLO, a
    mean over its `tokens`, at decode steps of `step_s`.

    vLLM runs a prefill chunk inside the decode step of every sequence in the batch, so each
    such step is one gap between the request's tokens. If no step exceeds the SLO, no gap does.
    Otherwise the request must absorb the prefill over its tokens: step_s + stall_s /
    (tokens - 1) within the SLO; one of unknown length cannot be judged so, and is refused."""
    if longest_s <= tbt_slo_s:
        return True
    return tokens is not None and step_s + stall_s / max(tokens - 1, 1) <= tbt_slo_s


def prefill_keeps_batch_tbt(inst: InstanceState, ends_s: float, longest_s: float, est: Estimators,
                            cfg: SchedulerConfig) -> bool:
    """Whether a prefill on `inst` in steps of at most `longest_s`, done at `ends_s`, keeps the
    TBT SLO of every sequence it would sit between the tokens of.

    A running sequence: per step, no step beyond its SLO (as before). Judged as a mean over its
    max_tokens instead, prefill went beside busy batches, where on the 2-core box the first
    token came up to 2x later than priced (benchmarks/RESULTS.md, "Sequences on their way").
    A sequence coming there before the prefill ends (`incoming`, start_s = predicted arrival):
    the part of the prefill after it arrives is a stall it must absorb (stall_keeps_tbt, a mean
    over its max_tokens). Before, these were not protected at all, and sequences of a few tokens
    waited up to 15 s between two of them behind a prompt colocated on their decode worker."""
    for seq in inst.running:
        if longest_s > seq_tbt_slo_s(seq, cfg):
            return False
    coming = [s for s in inst.incoming if s.start_s < ends_s]
    if not coming:
        return True
    step = est.tbt_s(len(inst.running) + len(coming), inst.kv_tokens + sum(s.kv_tokens for s in coming),
                     inst.decode_scale)
    for seq in coming:
        tokens = seq.remaining_tokens if seq.remaining_tokens is not None else seq.max_tokens
        if not stall_keeps_tbt(step, longest_s, ends_s - seq.start_s, tokens, seq_tbt_slo_s(seq, cfg)):
            return False
    return True


def batch_tbt_slo_s(inst: InstanceState, cfg: SchedulerConfig) -> float:
    """The tightest TBT SLO among the sequences running on or coming to `inst` (one without its
    own has the config's): a step of its batch, or a request joining it, must keep it. inf when
    it carries none."""
    if inst.any_config_tbt_slo:
        return min(inst.tightest_tbt_slo_s, cfg.tbt_slo_s)
    return inst.tightest_tbt_slo_s


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
    # A sequence with a max_tokens is surely gone at t* once that many steps fit between its
    # start and t*, whatever t_d says (t_d is every request's mean: a 4-token request would
    # otherwise hold its KV for a 64-token one's time). Steps are taken at twice the current
    # step time: a margin for the batch growing meanwhile.
    slowest_step = 2.0 * step

    def capped(s: DecodeSeq) -> bool:
        return s.max_tokens is not None and s.start_s + s.max_tokens * slowest_step <= h.t_star

    batch = kv = 0.0
    # Only where some sequence has a cap: the simulator's never do, and this runs per instance
    # per decision.
    running = [s for s in inst.running if not capped(s)] if inst.any_max_tokens else inst.running
    if h.fluid:
        w = max(1.0 - dt / h.t_d, 0.0)
        running_kv = inst.kv_tokens if len(running) == len(inst.running) else sum(s.kv_tokens for s in running)
        batch += w * len(running)
        kv += w * (running_kv + len(running) * dt / step)
    else:
        for s in running:
            if s.start_s + h.t_d > h.t_star:
                batch += 1
                kv += s.kv_tokens + dt / step
    for s in inst.incoming:
        if s.start_s + h.t_d > h.t_star and not (inst.any_max_tokens and capped(s)):
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
                 cfg: SchedulerConfig, lim: Limits, headroom: float = 0.0) -> DecodeChoice:
    return DecodeChoice(inst.instance_id, *_judge(inst, kv_need, view, h, est, cfg, lim, headroom))


def _judge(inst: InstanceState, kv_need: int, view: LoadView, h: Horizon, est: Estimators,
           cfg: SchedulerConfig, lim: Limits, headroom: float) -> tuple[float, RejectReason | None]:
    batch, kv = decode_load(inst, view, h, est)
    tbt = est.tbt_s(batch + 1, kv + kv_need, inst.decode_scale)
    if kv + kv_need > inst.kv_capacity_tokens * (1.0 - headroom):
        return tbt, RejectReason.NO_CAPACITY
    if tbt > lim.tbt_s or tbt > batch_tbt_slo_s(inst, cfg):
        return tbt, RejectReason.TBT_SLO
    return tbt, None


def rank_and_gate(inst: InstanceState, kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                  est: Estimators, cfg: SchedulerConfig, lim: Limits) -> DecodeChoice:
    """TBT under the rank view; problem under the gate view (with the gate's KV headroom)."""
    return DecodeChoice(inst.instance_id, *_rank_and_gate(inst, kv_need, views, h, est, cfg, lim))


def _rank_and_gate(inst: InstanceState, kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                   est: Estimators, cfg: SchedulerConfig, lim: Limits) -> tuple[float, RejectReason | None]:
    tbt, problem = _judge(inst, kv_need, views[0], h, est, cfg, lim, 0.0)
    gating = cfg.admission in (Admission.EARLY, Admission.PREDICTION)
    headroom = lim.kv_headroom if gating else 0.0
    if views[1] is views[0] and headroom == 0.0:
        return tbt, problem
    return tbt, _judge(inst, kv_need, views[1], h, est, cfg, lim, headroom)[1]


def choose_decode(pool: Sequence[InstanceState], kv_need: int, views: tuple[LoadView, LoadView], h: Horizon,
                  est: Estimators, cfg: SchedulerConfig, lim: Limits,
                  rng: random.Random | None = None) -> DecodeChoice:
    """Among instances that pass the gate view, the one with the lowest TBT under the rank
    view; if none passes, the lowest TBT overall, carrying its problem. With rng, a uniformly
    random instance."""
    if rng is not None:
        return rank_and_gate(rng.choice(pool), kv_need, views, h, est, cfg, lim)
    # Plain tuples in the loop, one DecodeChoice at the end: at 1,024 instances this loop is
    # half of a decision.
    best_ok: tuple[float, InstanceState] | None = None
    best_any: tuple[bool, float, InstanceState, RejectReason | None] | None = None
    for inst in pool:
        tbt, problem = _rank_and_gate(inst, kv_need, views, h, est, cfg, lim)
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
                           est: Estimators, cfg: SchedulerConfig, lim: Limits,
                           exclude: str) -> tuple[DecodeChoice, float] | None:
    """Flexible roles: the decode instance for a prefill done on `exclude`, among every other
    instance, and its role cost (cfg.role_cost_s for a prefill-labelled one). Order: passes
    the gate, then (among misfits) over the TBT SLO before over KV capacity, then the lower
    role cost (it adds to the pair's TTFT + cost), then the lower TBT. None if no other instance."""
    best: tuple[tuple[bool, bool, float, float], InstanceState, RejectReason | None] | None = None
    for inst in pool:
        if inst.instance_id == exclude:
            continue
        tbt, problem = _rank_and_gate(inst, kv_need, views, h, est, cfg, lim)
        key = (problem is not None, problem is RejectReason.NO_CAPACITY,
               cfg.role_cost_s if inst.role is Role.PREFILL else 0.0, tbt)
        if best is None or key < best[0]:
            best = (key, inst, problem)
    if best is None:
        return None
    key, inst, problem = best
    return DecodeChoice(inst.instance_id, key[3], problem), key[2]


def decode_admits(inst: InstanceState, kv_need: int, est: Estimators, cfg: SchedulerConfig,
                  lim: Limits | None = None) -> RejectReason | None:
    """The decode instance's own check when a prefilled request's KV arrives (baseline's only
    decode-side check, and the last line of defence under early and prediction). lim: the
    request's (limits_for); None, the config's SLOs."""
    lim = lim or Limits(cfg.ttft_slo_s, cfg.tbt_slo_s, 0.0)
    return judge_decode(inst, kv_need, LoadView.REPORTED, Horizon(0.0, 0.0, 1.0), est, cfg, lim).problem


def decode_drain_s(pool: Sequence[InstanceState], kv_need: int, now: float, t_d: float,
                   est: Estimators, cfg: SchedulerConfig, lim: Limits) -> float:
    """Seconds until some decode instance would take kv_need more tokens within the request's
    TBT limit and the tightest TBT SLO of the sequences still there, and within its KV capacity
    less the request's headroom (the gate's), if sequences end t_d after they start and nothing
    new arrives. inf if never."""
    best = math.inf
    for inst in pool:
        seqs = sorted(inst.running + inst.incoming, key=lambda s: s.start_s)
        # tightest[k]: the tightest TBT SLO among the sequences left once the first k have ended.
        tightest = [math.inf] * (len(seqs) + 1)
        for k in range(len(seqs) - 1, -1, -1):
            tightest[k] = min(seq_tbt_slo_s(seqs[k], cfg), tightest[k + 1])
        batch, kv = len(seqs), sum(s.kv_tokens for s in seqs)
        for k, s in enumerate([None, *seqs]):
            if s is not None:
                batch, kv = batch - 1, kv - s.kv_tokens
            tbt = est.tbt_s(batch + 1, kv + kv_need, inst.decode_scale)
            if kv + kv_need <= inst.kv_capacity_tokens * (1.0 - lim.kv_headroom) and tbt <= min(lim.tbt_s, tightest[k]):
                best = min(best, 0.0 if s is None else max(s.start_s + t_d - now, 0.0))
                break
    return best
