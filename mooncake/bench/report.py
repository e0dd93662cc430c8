"""What `mooncake bench` shows: a table per sweep, a JSON file of every request, PNG plots."""

from __future__ import annotations

import json
import math
import pathlib
from collections import Counter
from dataclasses import asdict

from mooncake.bench.stats import ERROR, REFUSED, RateSummary, RequestRecord, lower_rates_missing


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def percent(fraction: float) -> str:
    """One decimal, rounded down: rounded to nearest, 0.8996 would show as a 90.0% that misses a
    90% target."""
    return f"{math.floor(round(fraction * 1000, 6)) / 10:.1f}%"


def table(summaries: list[RateSummary], capacity: float | None, target: float) -> str:
    head = ("rate req/s", "dur s", "ok", "refused", "err", "TTFT p50", "p90", "p99", "TBT p50", "p90", "p99",
            "e2e p50", "p90", "attain", "goodput")
    rows = [head]
    for s in summaries:
        rows.append((rate_text(s.offered_rate), f"{s.duration_s:.1f}", str(s.completed), str(s.refused), str(s.errors),
                     _f(s.ttft_s["p50"]), _f(s.ttft_s["p90"]), _f(s.ttft_s["p99"]),
                     _f(s.tbt_s["p50"], 4), _f(s.tbt_s["p90"], 4), _f(s.tbt_s["p99"], 4),
                     _f(s.e2e_s["p50"]), _f(s.e2e_s["p90"]), percent(s.attainment), f"{s.goodput:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    cap = "none" if capacity is None else f"{capacity:.3g} req/s"
    lines.append(f"SLO capacity (highest offered rate with attainment >= {percent(target)}): {cap}")
    missed = lower_rates_missing(summaries, target, capacity)
    if missed:
        rates = ", ".join(f"{rate_text(s.offered_rate)} req/s ({percent(s.attainment)})" for s in missed)
        lines.append(f"warning: lower rates missed the target: {rates}; attainment is not monotonic in the rate, "
                     f"so the capacity of {cap} may not hold (rerun, or use more requests per rate)")
    for s in summaries:
        if s.ttft_over_predicted:
            r = s.ttft_over_predicted
            lines.append(f"at {rate_text(s.offered_rate)} req/s measured / predicted TTFT (server's scheduler, "
                         f"{r['n']} requests): p10 {r['p10']:.2f}, p50 {r['p50']:.2f}, p90 {r['p90']:.2f}")
        if s.short_outputs:
            lines.append(f"note: at {rate_text(s.offered_rate)} req/s {s.short_outputs} outputs were shorter "
                         f"than max_tokens")
        if s.without_usage:
            lines.append(f"note: at {rate_text(s.offered_rate)} req/s the server sent no usage count for "
                         f"{s.without_usage} answers, so their tokens and TBT are counted per text chunk")
        if s.max_send_lag_s > 0.1:
            lines.append(f"note: at {rate_text(s.offered_rate)} req/s a send left {s.max_send_lag_s:.2f} s late "
                         "(the client could not keep the schedule)")
    return "\n".join(lines)


def write_json(path: str | pathlib.Path, config: dict, runs: list[tuple[RateSummary, list[RequestRecord]]],
               warmup: list[RequestRecord], capacity: float | None) -> None:
    doc = {"config": config, "slo_capacity": capacity,
           "warmup": [r.to_json() for r in warmup],
           "runs": [{"summary": asdict(s), "requests": [r.to_json() for r in recs]} for s, recs in runs]}
    pathlib.Path(path).write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")


def error_lines(runs: list[tuple[RateSummary, list[RequestRecord]]], top: int = 3) -> list[str]:
    """Why requests failed or were refused, per rate: the commonest messages with their counts
    (the records in --out have every one)."""
    lines = []
    for s, recs in runs:
        for status, what in ((ERROR, "errors"), (REFUSED, "refused")):
            counts = Counter(r.error for r in recs if r.status == status)
            for message, count in counts.most_common(top):
                lines.append(f"{what} at {rate_text(s.offered_rate)} req/s: {count} x {message}")
            if len(counts) > top:
                lines.append(f"{what} at {rate_text(s.offered_rate)} req/s: ... and {len(counts) - top} other messages")
    return lines


def rate_text(rate: float) -> str:
    """An offered rate for people: '-' where the schedule defines none (every arrival at once)."""
    return f"{rate:.3g}" if math.isfinite(rate) else "-"


def _finite(value):
    """The document with non-finite numbers as null: JSON has no Infinity or NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_plots(out_dir: str | pathlib.Path, runs: list[tuple[RateSummary, list[RequestRecord]]],
                ttft_slo_s: float, target: float) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt
    import numpy as np

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for s, recs in runs:
        t = np.sort([r.ttft_s for r in recs if r.ttft_s is not None])
        if t.size:
            # y counts all requests sent: refused and failed ones never reach 1.0
            ax.step(t, np.arange(1, t.size + 1) / len(recs), where="post", label=f"{rate_text(s.offered_rate)} req/s")
    ax.axvline(ttft_slo_s, color="grey", ls=":", lw=1, label="TTFT SLO")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests sent")
    ax.set_title("TTFT CDF per offered rate", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    cdf = out / "ttft_cdf.png"
    fig.savefig(cdf)
    plt.close(fig)

    # In rate order, whatever order --rates swept them in; a rate that is not finite (a trace whose
    # arrivals share one instant) has no place on the axis.
    points = sorted((s for s, _ in runs if math.isfinite(s.offered_rate)), key=lambda s: s.offered_rate)
    rates = [s.offered_rate for s in points]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    a1.plot(rates, [s.attainment for s in points], "o-")
    a1.axhline(target, color="grey", ls=":", lw=1, label=f"target {percent(target)}")
    a1.set_ylim(0, 1.05)
    a1.set_xlabel("offered rate (req/s)")
    a1.set_ylabel("SLO attainment")
    a1.legend(fontsize=7)
    a2.plot(rates, [s.goodput for s in points], "o-")
    a2.set_xlabel("offered rate (req/s)")
    a2.set_ylabel("goodput (attaining req/s)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.tight_layout()
    att = out / "attainment_goodput.png"
    fig.savefig(att)
    plt.close(fig)
    return [cdf, att]
