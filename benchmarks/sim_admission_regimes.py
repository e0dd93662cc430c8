"""When does prediction-based early rejection pay? Overload replays (2x) across load regimes,
several seeds each, so that an ordering is only claimed where it beats the seed-to-seed noise.

  PYTHONPATH=. .venv/bin/python benchmarks/sim_admission_regimes.py --seeds 3 --write

--write also draws plots/admission_regimes.png.

Each regime is a generated trace (conductor.sim.trace.TraceParams; parameters printed in the
table) replayed at 2x against 8 prefill + 8 decode instances of profile paper-70b-8gpu with the
kvcache-centric policy, TTFT SLO 30 s, TBT SLO 0.1 s, and each admission policy. Every seed
draws a new trace and new duration noise. "prediction (oracle)" gives the scheduler every
request's true output length (simulator only): the best any decode-load forecast could do.

Columns per admission: mean over seeds of rejected requests (min-max), prefills wasted by a
refusal after prefill, requests completed within SLO, prompt tokens served within SLO, and the
mean prompt of completed requests (the size of what each policy chose to serve). "decode KV" and
"prefill queue" describe the regime: mean decode KV in use over capacity, and mean predicted
prefill queue over the TTFT SLO, over the middle 80 % of the arrival window under baseline.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from dataclasses import asdict, dataclass, replace

from conductor.core import SchedulerConfig, load_profile
from conductor.sim.cli import simulate
from conductor.sim.report import summarize
from conductor.sim.trace import TraceParams, generate_trace, records_of

from benchmarks.parallel import run_replays
from benchmarks.results_md import write_block

ROOT = pathlib.Path(__file__).resolve().parent
SLO = dict(ttft_slo_s=30.0, tbt_slo_s=0.1)
SPEEDUP = 2.0
_BASE = dict(n_requests=6000, prefix_blocks_mean=16.0, suffix_tokens_median=5000.0, output_sigma=0.7)
REGIMES = {
    "decode never full": TraceParams(**_BASE, rate_rps=5.0, output_median=300.0),
    "decode near full": TraceParams(**_BASE, rate_rps=5.0, output_median=900.0),
    "both overloaded": TraceParams(**_BASE, rate_rps=4.0, output_median=1200.0),
    "both overloaded, narrow prompts": TraceParams(**{**_BASE, "suffix_tokens_median": 7000.0},
                                                   suffix_sigma=0.3, rate_rps=4.0, output_median=1200.0),
    "bursty (rate +-60 %, 10 min period)": TraceParams(**_BASE, rate_rps=3.0, output_median=1200.0,
                                                       rate_amplitude=0.6, rate_period_s=600.0),
}
ADMISSIONS = {"baseline": ("baseline", {}), "early": ("early", {}), "prediction": ("prediction", {}),
              "prediction (oracle)": ("prediction", {"oracle_lengths": True})}
DEFAULT_PARAMS = TraceParams()


@dataclass(frozen=True, slots=True)
class Run:
    rejected: int
    wasted: int
    within_slo: int
    prompt_mtokens: float
    mean_prompt: float
    decode_kv: float
    prefill_queue: float


def _one(task: tuple[str, int]) -> tuple[str, int, dict[str, Run]]:
    regime, seed = task
    trace = records_of(generate_trace(replace(REGIMES[regime], seed=seed)))
    window = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0 / SPEEDUP
    profile = load_profile("paper-70b-8gpu")
    runs = {}
    for label, (adm, sim_extra) in ADMISSIONS.items():
        res = simulate(trace, SchedulerConfig(admission=adm, seed=seed, **SLO), profile, speedup=SPEEDUP,
                       seed=seed, **sim_extra)
        s = summarize(res, **SLO)
        mid = [p for p in res.timeline if 0.1 * window <= p.t_s <= 0.9 * window]
        runs[label] = Run(s["rejected"], s["wasted_prefills"], s["completed_within_slo"],
                          s["prompt_tokens_within_slo"] / 1e6, s["mean_prompt_completed"] or 0.0,
                          statistics.fmean(p.decode_kv_util for p in mid),
                          statistics.fmean(p.prefill_queue_s for p in mid) / SLO["ttft_slo_s"])
    return regime, seed, runs


def _params_text(p: TraceParams) -> str:
    changed = {k: v for k, v in asdict(p).items() if v != getattr(DEFAULT_PARAMS, k) and k != "seed"}
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in changed.items())


def table(results: dict[str, dict[int, dict[str, Run]]]) -> list[str]:
    out = ["| regime (trace parameters) | decode KV | prefill queue | admission | rejected (min-max) | wasted "
           "| within SLO | prompt Mtok within SLO | mean prompt completed |", "|---" * 9 + "|"]
    verdicts = []
    for regime, by_seed in results.items():
        seeds = sorted(by_seed)
        base = [by_seed[s]["baseline"] for s in seeds]
        first = True
        for label in ADMISSIONS:
            rs = [by_seed[s][label] for s in seeds]
            rej = [r.rejected for r in rs]
            head = (f"{regime} ({_params_text(REGIMES[regime])})", f"{statistics.fmean(r.decode_kv for r in base):.2f}",
                    f"{statistics.fmean(r.prefill_queue for r in base):.2f}") if first else ("", "", "")
            first = False
            out.append(f"| {' | '.join(head)} | {label} | {statistics.fmean(rej):.0f} ({min(rej)}-{max(rej)}) "
                       f"| {statistics.fmean(r.wasted for r in rs):.0f} | {statistics.fmean(r.within_slo for r in rs):.0f} "
                       f"| {statistics.fmean(r.prompt_mtokens for r in rs):.1f} "
                       f"| {statistics.fmean(r.mean_prompt for r in rs):,.0f} |")
        order = sum(1 for s in seeds if by_seed[s]["baseline"].rejected > by_seed[s]["early"].rejected
                    > by_seed[s]["prediction"].rejected)
        best = sum(1 for s in seeds if by_seed[s]["prediction"].within_slo
                   >= max(by_seed[s]["baseline"].within_slo, by_seed[s]["early"].within_slo))
        tokens = sum(1 for s in seeds if by_seed[s]["prediction"].prompt_mtokens
                     >= max(by_seed[s]["baseline"].prompt_mtokens, by_seed[s]["early"].prompt_mtokens))
        verdicts.append(f"- {regime}: rejected baseline > early > prediction on {order}/{len(seeds)} seeds; "
                        f"prediction completes the most within SLO on {best}/{len(seeds)}, serves the most "
                        f"prompt tokens within SLO on {tokens}/{len(seeds)}.")
    return out + [""] + verdicts


def plot(results: dict[str, dict[int, dict[str, Run]]], path: pathlib.Path) -> None:
    """Grouped bars per regime: mean rejected (whiskers: min-max over seeds), the part wasted
    after prefill hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(ADMISSIONS)
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(9, 3.8), dpi=90)
    for k, label in enumerate(labels):
        xs, mean, lo, hi, wasted = [], [], [], [], []
        for i, by_seed in enumerate(results.values()):
            rej = [r[label].rejected for r in by_seed.values()]
            xs.append(i + (k - (len(labels) - 1) / 2) * width)
            mean.append(statistics.fmean(rej))
            lo.append(mean[-1] - min(rej))
            hi.append(max(rej) - mean[-1])
            wasted.append(statistics.fmean(r[label].wasted for r in by_seed.values()))
        ax.bar(xs, mean, width, yerr=[lo, hi], capsize=2, label=label)
        ax.bar(xs, wasted, width, color="none", hatch="///", edgecolor="black", lw=0.5)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r.split(" (")[0].replace(", ", ",\n") for r in results], fontsize=8)
    ax.set_ylabel("rejected requests (hatched: after prefill)")
    ax.set_title("Overload at 2x, 8P+8D, kvcache-centric: rejections by admission policy", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds (trace and noise) per regime")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    ap.add_argument("--write", action="store_true",
                    help="replace the table between the sim-regimes markers in benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.jobs < 1:
        ap.error("--seeds and --jobs must be positive")
    tasks = [(r, s) for r in REGIMES for s in range(args.seeds)]
    results: dict[str, dict[int, dict[str, Run]]] = {r: {} for r in REGIMES}
    describe = lambda r: f"{r[0]} seed {r[1]}: " + ", ".join(f"{k} {v.rejected}" for k, v in r[2].items())  # noqa: E731
    for regime, seed, runs in run_replays(_one, tasks, args.jobs, describe):
        results[regime][seed] = runs
    text = "\n".join(table(results)) + "\n"
    print(text)
    if args.write:
        (ROOT / "plots").mkdir(exist_ok=True)
        plot(results, ROOT / "plots" / "admission_regimes.png")
        if not write_block("sim-regimes", text):
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
