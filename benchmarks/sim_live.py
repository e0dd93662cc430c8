"""Does the simulator, fed a live cluster's fitted profile, predict that cluster's SLO attainment?
(issue #12: within 10 points at three rates.)

    python benchmarks/sim_live.py --dtype float32 --rates 0.25,0.5,1.0 --requests 30

1. Starts `mooncake serve`, 1 prefill + 1 decode worker (one core each), with its default flexible
   roles and conditional disaggregation (`--roles fixed`: fixed roles, no conditional
   disaggregation, as the runs before flexible roles were simulated).
2. `mooncake bench`: a warm-up (the conductor's calibration learns the hardware), then Poisson
   arrivals at each rate, refusals counted as misses.
3. Saves the conductor's `GET /internal/debug/estimators` (its fitted scales) next to the records.
4. Replays each rate's measured requests in the simulator (`mooncake sim --fitted`'s profile): the
   same arrival times, prompt and output lengths, 1P+1D, the same SLOs and scheduler settings
   (conductor/sim/flex.py for flexible roles), each request's max_tokens known as live, averaged
   over several noise seeds.
5. Prints live and simulated attainment per rate and the difference in points.
Writes benchmarks/out/sim-live-<dtype>-<roles>/ (bench.json, estimators.json, report.md).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import statistics
from collections import Counter
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import servers  # noqa: E402
from benchmarks.goodput import routes_from_metrics  # noqa: E402
from conductor.config import live_scheduler_config  # noqa: E402
from conductor.core.calibration import cluster_scales, fitted_profile  # noqa: E402
from conductor.core.profile_table import load_profile  # noqa: E402
from conductor.sim.cli import simulate  # noqa: E402
from conductor.sim.report import summarize  # noqa: E402
from mooncake import defaults  # noqa: E402
from mooncake.auth import token_headers  # noqa: E402
from mooncake.bench import cli as bench_cli  # noqa: E402
from mooncake.model import ensure_model  # noqa: E402
from mooncake.trace import TraceRecord  # noqa: E402

GOAL_POINTS = 10.0


def trace_of(requests: list[dict], block_size: int) -> list[TraceRecord]:
    """A rate's measured requests as the simulator's trace: when each was scheduled to arrive,
    its prompt and output lengths, and block hashes no other request shares (bench's generated
    prompts are fresh random tokens: nothing is cached across them)."""
    out, next_id = [], 0
    for n, r in enumerate(sorted((r for r in requests if not r["warmup"]), key=lambda r: r["scheduled_s"])):
        blocks = math.ceil(r["input_length"] / block_size)
        out.append(TraceRecord(n + 1, 1000.0 * r["scheduled_s"], r["input_length"], r["max_tokens"],
                               tuple(range(next_id, next_id + blocks))))
        next_id += blocks
    return out


def simulated_attainment(trace: list[TraceRecord], profile,
                         args: argparse.Namespace) -> tuple[float, list[float], dict[str, int]]:
    """(mean attainment over the noise seeds, each seed's, the routes summed over the seeds)."""
    flexible = args.roles == "flexible"
    sched = live_scheduler_config(ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo, flexible_roles=flexible,
                                  conditional_disaggregation=flexible)
    got, routes = [], Counter()
    for seed in range(args.sim_seeds):
        # bench sends max_tokens = the output length (ignore_eos): the conductor knows it exactly.
        res = simulate(trace, sched, profile, n_prefill=1, n_decode=1, noise_sigma=args.noise, seed=seed,
                       max_tokens_known=True)
        summary = summarize(res, args.ttft_slo, args.tbt_slo)
        got.append(summary["slo_attainment"])
        routes.update(summary["routes"])
    return statistics.mean(got), got, dict(sorted(routes.items()))


def fmt_routes(routes: dict[str, float]) -> str:
    return ", ".join(f"{kind} {count:g}" for kind, count in sorted(routes.items())) or "none"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    p.add_argument("--rates", default="0.25,0.5,1.0", help="offered rates in req/s")
    p.add_argument("--requests", type=int, default=30, help="requests per rate")
    p.add_argument("--input-len", default="1000-3000", help="prompt tokens, MIN-MAX")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=20, help="requests before measuring (calibration learns)")
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--roles", default="flexible", choices=("flexible", "fixed"),
                   help="flexible: serve's defaults (flexible roles, conditional disaggregation); fixed: neither")
    p.add_argument("--sim-seeds", type=int, default=5, help="noise seeds the simulation is averaged over")
    p.add_argument("--noise", type=float, default=0.1, help="the simulator's lognormal sigma per duration")
    p.add_argument("--replay", action="store_true",
                   help="run no live cluster: simulate again the live run saved in the output folder (its "
                        "bench.json, estimators.json and routes.json), e.g. after a change to the simulator")
    args = p.parse_args()
    out_dir = ROOT / "benchmarks" / "out" / f"sim-live-{args.dtype}-{args.roles}"
    bench_out = out_dir / "bench.json"
    if args.replay:
        try:
            doc = json.loads((out_dir / "estimators.json").read_text())
            routes_file = out_dir / "routes.json"
            live_routes = json.loads(routes_file.read_text()) if routes_file.exists() else {}
            bench_out.stat()
        except OSError as exc:
            print(f"--replay: no saved live run in {out_dir}: {exc}", file=sys.stderr)
            return 2
        return report(args, doc, live_routes, bench_out, out_dir)
    model = str(ensure_model())
    out_dir.mkdir(parents=True, exist_ok=True)
    token_file = out_dir / "cluster-token"
    token_file.write_text(secrets.token_hex(16))
    token_file.chmod(0o600)
    extra = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo), "--cluster-token-file", str(token_file)]
    if args.roles == "fixed":
        extra += ["--no-flexible-roles", "--no-conditional-disaggregation"]
    with servers.mooncake_cluster(model, out_dir / "logs", extra=extra, dtype=args.dtype) as url:
        code = bench_cli.main(["--url", url, "--model", servers.MODEL_NAME, "--num-requests", str(args.requests),
                               "--input-len", args.input_len, "--output-len", str(args.output_len),
                               "--seed", str(args.seed), "--rates", args.rates, "--warmup", str(args.warmup),
                               "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
                               "--out", str(bench_out)])
        if code != 0:
            print(f"mooncake bench exited with {code}", file=sys.stderr)
            return 1
        fitted = httpx.get(url.removesuffix("/v1") + "/internal/debug/estimators", timeout=10,
                           headers=token_headers(token_file.read_text()))
        fitted.raise_for_status()
        live_routes = routes_from_metrics(httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text)
    doc = fitted.json()
    (out_dir / "estimators.json").write_text(json.dumps(doc, indent=1))
    (out_dir / "routes.json").write_text(json.dumps(live_routes))
    return report(args, doc, live_routes, bench_out, out_dir)


def report(args: argparse.Namespace, doc: dict, live_routes: dict, bench_out: Path, out_dir: Path) -> int:
    """Simulate each rate's measured requests with the cluster's fitted profile; print and save
    live against simulated attainment."""
    prefill_scale, decode_scale = cluster_scales(doc)
    profile = fitted_profile(load_profile(doc["profile"]), prefill_scale, decode_scale)
    runs = json.loads(bench_out.read_text())["runs"]
    lines = [f"dtype {args.dtype}; {args.requests} requests per rate after {args.warmup} warm-up, prompts "
             f"{args.input_len} tokens, {args.output_len} output tokens; SLO TTFT <= {args.ttft_slo} s, mean TBT "
             f"<= {args.tbt_slo} s; live: mooncake serve 1P+1D, " + ("flexible roles and conditional disaggregation"
                                                                    if args.roles == "flexible" else
                                                                    "fixed roles, no conditional disaggregation"),
             f"fitted profile: {doc['profile']} x prefill {prefill_scale:.3f}, decode step {decode_scale:.3f}; "
             f"simulation averaged over {args.sim_seeds} noise seeds (sigma {args.noise})", "",
             f"live routes, warm-up included: {fmt_routes(live_routes)}", "",
             "| rate (req/s) | live attainment | simulated attainment (seeds) | difference (points) | "
             "simulated routes (all seeds) |",
             "|---|---|---|---|---|"]
    worst = 0.0
    for run in runs:
        s = run["summary"]
        trace = trace_of(run["requests"], defaults.KV_BLOCK_SIZE)
        sim, per_seed, routes = simulated_attainment(trace, profile, args)
        diff = 100 * (sim - s["attainment"])
        worst = max(worst, abs(diff))
        lines.append(f"| {s['offered_rate']:g} | {100 * s['attainment']:.0f} % ({s['refused']} refused) | "
                     f"{100 * sim:.0f} % ({', '.join(f'{100 * a:.0f}' for a in per_seed)}) | {diff:+.1f} | "
                     f"{fmt_routes(routes)} |")
    lines += ["", f"largest difference {worst:.1f} points (goal: within {GOAL_POINTS:g}): "
                  f"{'met' if worst <= GOAL_POINTS else 'missed'}"]
    text = "\n".join(lines)
    print(text)
    (out_dir / "report.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
