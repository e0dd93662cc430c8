"""Paper section 5 and 6 experiments in the simulator; writes the scheduler section of RESULTS.md.

  PYTHONPATH=. .venv/bin/python benchmarks/make_trace.py --preset chat --out benchmarks/out/chat.jsonl
  PYTHONPATH=. .venv/bin/python benchmarks/make_trace.py --preset longgen --out benchmarks/out/longgen.jsonl
  PYTHONPATH=. .venv/bin/python benchmarks/make_trace.py --preset coupled --out benchmarks/out/coupled.jsonl
  PYTHONPATH=. .venv/bin/python benchmarks/sim_policies.py --write

Setting: 8 prefill + 8 decode instances, profile paper-70b-8gpu (LLaMA2-70B-class on 8x A800,
derived in conductor/core/profile_table.py), durations with 10 % lognormal noise, TTFT SLO
30 s, TBT SLO 0.1 s, KVCache pool 4,768 blocks (800 GB) per prefill node.
  A. selection policies, admission none, replayed at 1x (paper Figure 6 / FAST'25 Fig. 5);
  B. overload: kvcache-centric with each admission policy, replayed at 2x (paper Table 2).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from conductor.core import SchedulerConfig, load_profile
from conductor.sim.cli import simulate
from conductor.sim.plots import plot_load, plot_ttft_cdf
from conductor.sim.report import summarize
from conductor.sim.trace import load_trace

from benchmarks.results_md import write_block

ROOT = pathlib.Path(__file__).resolve().parent
PLOTS = ROOT / "plots"
TRACES = {"released synthetic": str(ROOT.parent.parent / "shared/traces/synthetic_trace.jsonl"),
          "ours: chat": str(ROOT / "out/chat.jsonl"), "ours: longgen": str(ROOT / "out/longgen.jsonl"),
          "ours: coupled": str(ROOT / "out/coupled.jsonl")}
POLICIES = ["random", "load-balance", "cache-aware", "kvcache-centric"]
PAPER_TTFT = {"random": 19.65, "load-balance": 5.27, "cache-aware": 3.58, "kvcache-centric": 3.07}
# (label, SchedulerConfig overrides, simulator overrides)
ADMISSIONS = [("none", {}, {}), ("baseline", {}, {}), ("early", {}, {}), ("prediction", {}, {}),
              ("prediction (age forecast)", {"decode_forecast": "age"}, {}),
              ("prediction (oracle lengths)", {}, {"oracle_lengths": True})]
PAPER_REJECTED = {"baseline": 4183, "early": 3771, "prediction": 3589}
SLO = dict(ttft_slo_s=30.0, tbt_slo_s=0.1)


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")


def policies(profile, out: list[str]) -> None:
    out += ["", "**A. Selection policies** (admission none, 1x; average TTFT of all requests, seconds)", "",
            "| trace | " + " | ".join(POLICIES) + " | ordering as paper? |", "|---" * (len(POLICIES) + 2) + "|",
            "| paper (real trace) | " + " | ".join(f"{PAPER_TTFT[p]}" for p in POLICIES) + " | - |"]
    detail = ["", "| trace | policy | mean TTFT s | p50 | p90 | p99 | SLO attainment | goodput req/s |",
              "|---|---|---|---|---|---|---|---|"]
    for name in ("released synthetic", "ours: chat"):
        trace = load_trace(TRACES[name])
        runs, means = {}, []
        for pol in POLICIES:
            res = simulate(trace, SchedulerConfig(policy=pol, admission="none", **SLO), profile)
            s = summarize(res, **{"ttft_slo_s": 30.0, "tbt_slo_s": 0.1})
            runs[pol] = res
            means.append(s["mean_ttft_s"])
            detail.append(f"| {name} | {pol} | {s['mean_ttft_s']:.2f} | {s['p50_ttft_s']:.2f} | {s['p90_ttft_s']:.2f} "
                          f"| {s['p99_ttft_s']:.2f} | {s['slo_attainment']:.3f} | {s['goodput_rps']:.3f} |")
            print(detail[-1], flush=True)
        ordered = all(a > b for a, b in zip(means, means[1:]))
        out.append(f"| {name} | " + " | ".join(f"{m:.2f}" for m in means) + f" | {'yes' if ordered else 'NO'} |")
        plot_ttft_cdf(runs, PLOTS / f"ttft_cdf_{slug(name)}.png", f"TTFT CDF, {name}, 8P+8D, 1x", 30.0)
    out += detail


def overload(profile, out: list[str]) -> None:
    out += ["", "**B. Overload** (kvcache-centric, 2x replay speed)", "",
            "| trace | admission | rejected | of which after prefill (wasted) | completed | completed within SLO "
            "| prompt Mtokens within SLO | mean prompt completed | goodput req/s | mean TTFT s | p90 TBT s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            "| paper (real trace, 2x) | baseline / early / prediction | 4183 / 3771 / 3589 | - | - | - | - | - | - | - "
            "| - |"]
    for name in ("released synthetic", "ours: longgen", "ours: coupled"):
        trace = load_trace(TRACES[name])
        for label, extra, sim_extra in ADMISSIONS:
            adm = label.split(" ")[0]
            res = simulate(trace, SchedulerConfig(admission=adm, **SLO, **extra), profile, speedup=2.0, **sim_extra)
            s = summarize(res, 30.0, 0.1)
            out.append(f"| {name} | {label} | {s['rejected']} | {s['wasted_prefills']} | {s['completed']} "
                       f"| {s['completed_within_slo']} | {s['prompt_tokens_within_slo'] / 1e6:.1f} "
                       f"| {s['mean_prompt_completed']:,.0f} | {s['goodput_rps']:.3f} | {s['mean_ttft_s']:.2f} "
                       f"| {s['p90_tbt_s']:.3f} |")
            print(out[-1], flush=True)
            if adm in ("baseline", "early", "prediction") and not extra and not sim_extra:
                plot_load(res, PLOTS / f"load_{slug(name)}_{adm}.png", f"{name}, {adm}, 2x", 30.0, 0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="replace the scheduler section's generated tables in "
                                                         "benchmarks/RESULTS.md (between the sim markers)")
    args = ap.parse_args(argv)
    for name, path in TRACES.items():
        if not pathlib.Path(path).exists():
            print(f"missing trace {path} ({name}); run benchmarks/make_trace.py first", file=sys.stderr)
            return 2
    PLOTS.mkdir(exist_ok=True)
    profile = load_profile("paper-70b-8gpu")
    out: list[str] = []
    policies(profile, out)
    overload(profile, out)
    text = "\n".join(out) + "\n"
    print(text)
    if args.write:
        if not write_block("sim-tables", text):
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
