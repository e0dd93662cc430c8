"""Results of a replay and the summary metrics computed from them.

TBT of a request is its mean time between tokens after the first: (finish - first token) /
(output - 1), so it includes the KV hand-off and any wait for KV room. The token-level TBT
percentile weighs each decode step by its batch size (every running request waited that
long for that token). A request meets its SLO when it completed, its TTFT <= ttft_slo and
its TBT <= tbt_slo; goodput is such requests per second of makespan.

Counting requests rewards refusing big ones: under a decode-bound overload, a policy that
serves longer prompts completes fewer requests with the same KV. So the summary also gives
the mean prompt of completed requests and the prompt tokens served within SLO.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Outcome:
    rid: int
    arrival_s: float
    prompt: int
    output: int
    status: str  # "completed" | "rejected"
    reason: str | None = None  # rejection reason; "decode_*" = refused after prefill
    ttft_s: float | None = None
    tbt_s: float | None = None
    finish_s: float | None = None
    colocated: bool = False  # prefilled on its decode instance (conditional disaggregation)
    route: str | None = None  # as the live conductor's mooncake_routes_total counts it; None: refused unrouted


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    t_s: float
    prefill_queue_s: float  # mean predicted queued prefill seconds per prefill node
    decode_batch: float  # mean running batch per decode node
    decode_kv_util: float  # mean fraction of decode KV capacity in use
    decode_tbt_s: float  # mean predicted step time of the decode nodes


@dataclass(slots=True)
class SimResult:
    outcomes: list[Outcome]
    timeline: list[TimelinePoint]
    step_times: list[tuple[float, int]]
    makespan_s: float
    wall_s: float
    wasted_prefill_s: float
    meta: dict = field(default_factory=dict)


def _pct(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q)) if a.size else None


def summarize(res: SimResult, ttft_slo_s: float, tbt_slo_s: float) -> dict:
    done = [o for o in res.outcomes if o.status == "completed"]
    rejected = [o for o in res.outcomes if o.status == "rejected"]
    ttft = np.array([o.ttft_s for o in done], dtype=float)
    tbt = np.array([o.tbt_s for o in done if o.tbt_s is not None], dtype=float)
    good_list = [o for o in done if o.ttft_s <= ttft_slo_s and (o.tbt_s is None or o.tbt_s <= tbt_slo_s)]
    good = len(good_list)
    reasons: dict[str, int] = {}
    for o in rejected:
        reasons[o.reason or "?"] = reasons.get(o.reason or "?", 0) + 1
    if res.step_times:
        st = np.array(res.step_times, dtype=float)
        order = np.argsort(st[:, 0])
        cum = np.cumsum(st[order, 1])
        token_p90 = float(st[order, 0][np.searchsorted(cum, 0.9 * cum[-1])])
    else:
        token_p90 = None
    n = len(res.outcomes)
    return {
        "requests": n,
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "wasted_prefills": sum(1 for o in rejected if (o.reason or "").startswith("decode_")),
        "wasted_prefill_s": round(res.wasted_prefill_s, 3),
        "colocated_prefills": sum(1 for o in res.outcomes if o.colocated),
        "routes": dict(sorted(Counter(o.route for o in res.outcomes if o.route).items())),
        "completed_within_slo": good,
        "mean_prompt_completed": float(np.mean([o.prompt for o in done])) if done else None,
        "prompt_tokens_within_slo": sum(o.prompt for o in good_list),
        "mean_ttft_s": float(ttft.mean()) if ttft.size else None,
        "p50_ttft_s": _pct(ttft, 50),
        "p90_ttft_s": _pct(ttft, 90),
        "p99_ttft_s": _pct(ttft, 99),
        "mean_tbt_s": float(tbt.mean()) if tbt.size else None,
        "p90_tbt_s": _pct(tbt, 90),
        "p99_tbt_s": _pct(tbt, 99),
        "p90_token_tbt_s": token_p90,
        "slo_attainment": good / n if n else 0.0,
        "goodput_rps": good / res.makespan_s if res.makespan_s > 0 else 0.0,
        "makespan_s": res.makespan_s,
        "sim_wall_s": res.wall_s,
        "sim_requests_per_s": n / res.wall_s if res.wall_s > 0 else None,
        **res.meta,
    }
