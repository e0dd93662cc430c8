"""Pricing prefixes still being computed: mean TTFT of every selection policy with the scheduler
blind to them (only stored blocks count) and aware of them (PendingPrefixes), on traces the
policies were never tuned on.

  PYTHONPATH=. .venv/bin/python benchmarks/sim_pending_prefixes.py --write

A grid of 12 workloads (TraceParams: rate, number and popularity of shared prefixes, prefix and
suffix lengths, output length), 3 seeds each (a new trace and new noise), 2,000 requests, 8+8
instances, profile paper-70b-8gpu, admission none at 1x (as table A). For each workload the
table gives the mean over seeds of each policy's mean TTFT, blind and aware, and on how many
seeds the paper's ordering random > load-balance > cache-aware > kvcache-centric holds.
"""

from __future__ import annotations

import argparse
import sys

from conductor.core import SchedulerConfig, load_profile
from conductor.sim.cli import simulate
from conductor.sim.report import summarize
from conductor.sim.trace import TraceParams, generate_trace, records_of

from benchmarks.parallel import run_replays
from benchmarks.results_md import write_block

POLICIES = ("random", "load-balance", "cache-aware", "kvcache-centric")
# (rate req/s, shared prefixes, Zipf a, prefix blocks mean, suffix median tokens, output median)
GRID = [(2, 200, 1.1, 12, 3000, 300), (4, 200, 1.1, 12, 3000, 300), (6, 200, 1.1, 12, 3000, 300),
        (4, 20, 1.1, 12, 3000, 300), (4, 2000, 1.1, 12, 3000, 300), (4, 200, 0.5, 12, 3000, 300),
        (4, 200, 2.0, 12, 3000, 300), (4, 200, 1.1, 40, 1000, 300), (3, 200, 1.1, 2, 8000, 300),
        (1, 200, 1.1, 12, 3000, 300), (8, 200, 1.1, 4, 500, 100), (3, 50, 1.5, 60, 500, 50)]
SEEDS = (100, 101, 102)


def _one(task: tuple[int, int]) -> tuple[int, int, dict[bool, list[float]]]:
    g, seed = task
    rate, n_prefixes, zipf_a, prefix_blocks, suffix, output = GRID[g]
    trace = records_of(generate_trace(TraceParams(
        n_requests=2000, rate_rps=rate, n_prefixes=n_prefixes, zipf_a=zipf_a, prefix_blocks_mean=prefix_blocks,
        suffix_tokens_median=suffix, output_median=output, seed=seed)))
    profile = load_profile("paper-70b-8gpu")
    out: dict[bool, list[float]] = {}
    for aware in (False, True):
        out[aware] = [summarize(simulate(trace, SchedulerConfig(policy=p, admission="none"), profile, seed=seed,
                                         pending_prefixes=aware), 30.0, 0.1)["mean_ttft_s"] for p in POLICIES]
    return g, seed, out


def _ordered(v: list[float]) -> bool:
    return all(v[i] > v[i + 1] for i in range(len(v) - 1))


def table(results: dict[tuple[int, int], dict[bool, list[float]]]) -> str:
    out = ["| workload (rate, prefixes, Zipf a, prefix blocks, suffix, output) | blind: random / LB / CA / KVC | "
           "aware: random / LB / CA / KVC | ordering holds blind | aware |", "|---|---|---|---|---|"]
    totals = {False: [0.0] * 4, True: [0.0] * 4}
    holds = {False: 0, True: 0}
    for g, params in enumerate(GRID):
        cells = []
        for aware in (False, True):
            runs = [results[(g, s)][aware] for s in SEEDS]
            mean = [sum(r[i] for r in runs) / len(runs) for i in range(4)]
            totals[aware] = [a + b for a, b in zip(totals[aware], mean)]
            n_ok = sum(_ordered(r) for r in runs)
            holds[aware] += n_ok
            cells.append((" / ".join(f"{x:.2f}" for x in mean), f"{n_ok}/{len(runs)}"))
        out.append(f"| {', '.join(str(p) for p in params)} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | "
                   f"{cells[1][1]} |")
    n = len(GRID) * len(SEEDS)
    out.append("")
    out.append("Sum over workloads of mean TTFT, blind -> aware: " + "; ".join(
        f"{p} {totals[False][i]:.1f} -> {totals[True][i]:.1f} s ({totals[True][i] / totals[False][i]:.2f}x)"
        for i, p in enumerate(POLICIES)) + f". Ordering holds on {holds[False]}/{n} runs blind, "
        f"{holds[True]}/{n} aware.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--write", action="store_true",
                    help="replace the table between the sim-pending markers in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    tasks = [(g, s) for g in range(len(GRID)) for s in SEEDS]
    results: dict[tuple[int, int], dict[bool, list[float]]] = {}
    for g, s, out in run_replays(_one, tasks, args.jobs, lambda r: f"workload {r[0]} seed {r[1]} done"):
        results[(g, s)] = out
    text = table(results)
    print(text)
    if args.write and not write_block("sim-pending", text):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
