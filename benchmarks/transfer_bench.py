"""Messenger throughput (issue #13): our transfer engine next to its limits and its peers, in one run.

    python -m benchmarks.transfer_bench            # everything (installs the peers' venvs once)
    python -m benchmarks.transfer_bench --quick    # a smoke run: few, small rounds
    python -m benchmarks.transfer_bench --only limits,ours
    python -m benchmarks.transfer_bench --write-results   # and update RESULTS.md + its chart

What it measures: write and read throughput between two processes for batches of slices (8 x 1 MiB
and 8 x 16 MiB by default), several batches in flight, each (op, size) timed over repeated rounds
of hundreds of MiB after a warm-up round; it prints the median GB/s and the spread (min-max).
Every read is checked against the target's bytes and every write against the initiator's, so a
fast wrong transfer shows up as "bytes WRONG".

- limits: a numpy memory copy of the same slices in one process; a raw TCP socket between two
  processes, one stream and N streams (`--streams`, default: our tcp transport's streams per peer);
- ours: each transport of `messenger.engine.TransferEngine` that runs here (tcp, shm, nixl over
  UCX tcp and over UCX shared memory when nixl_cu12 is installed in our venv), as shipped
  (checksums on), through write() and read(); a transport that cannot run shows as
  "not available" with the engine's reason;
- peers, each in its own virtualenv under .venvs/, built on first use and reused: Mooncake's
  Transfer Engine over TCP (benchmarks/peers/venv.py) and NIXL over UCX tcp and shared memory
  (benchmarks/peers/nixl_venv.py), the latter twice: as vLLM's NixlConnector configures it
  (a spinning progress thread) and with its progress thread sleeping between idle polls. Their
  workers run as subprocesses in those venvs.

Then the issue's goals, from medians of the same run: our tcp / Mooncake TE tcp >= 2x; our best
path / NIXL on the same wire >= 0.9x; our shm / memory copy >= 0.7x. The table and the ratios are
printed as markdown; the raw samples go to a JSON file and a bar chart to a PNG (matplotlib).
Progress lines go to stderr. The machine should be otherwise idle: absolute figures move with
load; ratios of one run are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.peers.nixl_venv import ensure_nixl_venv, ucx_env
from benchmarks.peers.venv import ensure_peer_venv
from benchmarks.results_md import write_block
from benchmarks.transfer.common import MiB, Plan
from benchmarks.transfer.report import Case, Goal, bar_chart, ratio_lines, ratios, summarize, table
from benchmarks.transfer.runner import WorkerFailed, WorkerSpec, run_alone, run_pair
from messenger.engine import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = REPO_ROOT / "benchmarks" / "transfer"
OUT_DIR = REPO_ROOT / "benchmarks" / "out"
PLOT = REPO_ROOT / "benchmarks" / "plots" / "transfer_bench.png"
GROUPS = ("limits", "ours", "mooncake", "nixl")
# Peers' loggers: Mooncake's glog writes a line per transfer at INFO.
PEER_QUIET = {"GLOG_minloglevel": "1", "NIXL_LOG_LEVEL": "WARN"}
NIXL_DELAY_US = 100
NIXL_DELAY_ENV = (("NIXL_BENCH_PROGRESS_DELAY_US", str(NIXL_DELAY_US)),)  # read by nixl_worker.py


def cases(streams: int) -> dict[str, list[Case]]:
    return {
        "limits": [Case("limit", "memcpy", "memory"), Case("limit", "raw tcp x1", "tcp"),
                   Case("limit", f"raw tcp x{streams}", "tcp")],
        "ours": [Case("ours", "tcp", "tcp"), Case("ours", "shm", "shm"),
                 Case("ours", "nixl/tcp", "tcp"), Case("ours", "nixl/shm", "shm")],
        "mooncake": [Case("Mooncake TE", "tcp", "tcp")],
        # NIXL as vLLM's NixlConnector configures it (its progress thread spins), and with the
        # progress thread sleeping between idle polls, which is faster or slower depending on
        # how loaded the two cores are; the goals compare with the better of the two.
        "nixl": [Case("NIXL", "tcp", "tcp"), Case("NIXL", "shm", "shm"),
                 Case("NIXL", f"tcp, progress {NIXL_DELAY_US} us", "tcp", NIXL_DELAY_ENV),
                 Case("NIXL", f"shm, progress {NIXL_DELAY_US} us", "shm", NIXL_DELAY_ENV)],
    }


def goals(all_cases: list[Case]) -> list[Goal]:
    def named(system: str, wire: str) -> tuple[str, ...]:
        return tuple(c.name for c in all_cases if c.system == system and c.wire == wire)
    return [Goal("ours tcp / Mooncake TE tcp", ("ours tcp",), ("Mooncake TE tcp",), 2.0, wire="tcp"),
            Goal("ours best on tcp / NIXL tcp", named("ours", "tcp"), named("NIXL", "tcp"), 0.9),
            Goal("ours best on shm / NIXL shm", named("ours", "shm"), named("NIXL", "shm"), 0.9),
            Goal("ours shm / memory copy", ("ours shm",), ("limit memcpy",), 0.7)]


def worker_spec(case: Case, streams: int, python: dict[str, str]) -> WorkerSpec:
    """How to start the workers of `case` (python: the peers' interpreters, by group)."""
    ours_python = sys.executable
    if case.system == "limit":
        wire = "memcpy" if case.transport == "memcpy" else f"tcp{case.transport.rsplit('x', 1)[1]}"
        return WorkerSpec([ours_python, "-m", "benchmarks.transfer.limits_worker"], cwd=str(REPO_ROOT), wire=wire)
    if case.system == "ours":
        transport, _, ucx_wire = case.transport.partition("/")
        env = ucx_env(ucx_wire) if ucx_wire else None
        return WorkerSpec([ours_python, "-m", "benchmarks.transfer.ours_worker"], env=env, cwd=str(REPO_ROOT),
                          wire=transport)
    if case.system == "Mooncake TE":
        return WorkerSpec([python["mooncake"], str(WORKERS / "te_worker.py")], env={**os.environ, **PEER_QUIET},
                          cwd="/", wire="tcp")
    return WorkerSpec([python["nixl"], str(WORKERS / "nixl_worker.py")],
                      env={**ucx_env(case.wire), **PEER_QUIET, **dict(case.env)}, cwd="/", wire=case.wire)


def peer_pythons(groups: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Build (once) the peers' venvs; returns their pythons and, per group, why one failed."""
    found, failed = {}, {}
    for group, ensure in (("mooncake", ensure_peer_venv), ("nixl", ensure_nixl_venv)):
        if group in groups:
            print(f"[peers] preparing the {group} venv (built once, then reused)", file=sys.stderr, flush=True)
            try:
                found[group] = str(ensure())
            except Exception as e:  # noqa: BLE001 - any install failure is reported in the table
                failed[group] = f"venv not built: {e}"
    return found, failed


def make_plan(args: argparse.Namespace) -> Plan:
    sizes = tuple(int(s) * MiB for s in args.sizes.split(","))
    if args.quick:
        return Plan(sizes, args.slices, inflight=2, round_bytes=64 * MiB, rounds=2, warmup_rounds=1)
    return Plan(sizes, args.slices, args.inflight, args.round_mib * MiB, args.rounds, warmup_rounds=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 batches in flight, 64 MiB rounds, 2 timed rounds (figures not meaningful)")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups to run, from {','.join(GROUPS)} (default: all)")
    parser.add_argument("--sizes", default="1,16", help="slice sizes in MiB (default: 1,16)")
    parser.add_argument("--slices", type=int, default=8, help="slices per batch (default: 8)")
    parser.add_argument("--inflight", type=int, default=4, help="batches in flight (default: 4)")
    parser.add_argument("--round-mib", type=int, default=512, help="MiB moved per timed round (default: 512)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per (op, size) (default: 7)")
    parser.add_argument("--streams", type=int, default=EngineConfig().tcp_streams,
                        help="streams of the multi-stream raw socket (default: our tcp transport's, %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=900, help="limit per measured case (default: 900)")
    parser.add_argument("--json", default=str(OUT_DIR / "transfer_bench.json"), help="where the raw numbers go")
    parser.add_argument("--plot", default=str(OUT_DIR / "transfer_bench.png"), help="bar chart PNG ('' for none)")
    parser.add_argument("--write-results", action="store_true",
                        help="also put the table and ratios into RESULTS.md (between its transfer markers) "
                             "and the chart into benchmarks/plots/transfer_bench.png")
    parser.add_argument("--verbose", action="store_true", help="also pass the workers' other output to stderr")
    args = parser.parse_args(argv)
    args.groups = [g for g in args.only.split(",") if g]
    unknown = set(args.groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    return args


def run(args: argparse.Namespace) -> tuple[dict, list[Case]]:
    plan = make_plan(args)
    chosen = [c for g in args.groups for c in cases(args.streams)[g]]
    python, failed_venvs = peer_pythons(args.groups)
    rows, unavailable, started, load_at_start = [], {}, time.time(), os.getloadavg()
    for i, case in enumerate(chosen, 1):
        group = next(g for g, cs in cases(args.streams).items() if case in cs)
        print(f"[{i}/{len(chosen)}] {case.name}", file=sys.stderr, flush=True)
        if group in failed_venvs:
            unavailable[case.name] = failed_venvs[group]
            continue
        spec = worker_spec(case, args.streams, python)
        try:
            runner = run_alone if spec.wire == "memcpy" else run_pair
            results = runner(spec, plan, case.name, args.timeout_s, args.verbose)
        except WorkerFailed as e:
            reason = str(e) if e.unavailable else f"failed: {e}"
            unavailable[case.name] = reason
            print(f"    {case.name}: {reason}", file=sys.stderr, flush=True)
            continue
        rows += [summarize(case, r) for r in results]
    return {"plan": json.loads(plan.to_json()), "quick": args.quick, "started": started,
            "seconds": time.time() - started, "host": platform.node(), "cpus": os.cpu_count(),
            "load_average_start": load_at_start, "load_average_end": os.getloadavg(), "cases": [asdict(c) for c in chosen], "rows": rows,
            "unavailable": unavailable, "ratios": ratios(goals(chosen), rows)}, chosen


def report_text(result: dict, chosen: list[Case]) -> str:
    plan = result["plan"]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(result["started"]))
    load = "/".join(f"{a:.1f}" for a in (result["load_average_start"][0], result["load_average_end"][0]))
    return "\n".join([
        f"Run of {when}, {result['seconds']:.0f} s, {result['cpus']} CPUs, load average {load} (start/end)"
        f"{'; QUICK: a smoke run, not figures' if result['quick'] else ''}.",
        f"GB/s, median (min-max) of {plan['rounds']} rounds of {plan['round_bytes'] // MiB} MiB after "
        f"{plan['warmup_rounds']} warm-up; batches of {plan['slices_per_batch']} slices, {plan['inflight']} in flight; "
        "every row's bytes checked.", "",
        table(chosen, result["rows"], result["unavailable"]), "",
        ratio_lines(result["ratios"])])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, chosen = run(args)
    text = report_text(result, chosen)
    print("\n" + text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nraw numbers: {args.json}")
    if args.plot and result["rows"]:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        made = bar_chart(chosen, result["rows"], args.plot, "Messenger throughput (issue #13)")
        print(f"chart: {made}" if made else "chart: not drawn (matplotlib is not installed)")
    if args.write_results:
        made = bar_chart(chosen, result["rows"], str(PLOT), "Messenger throughput (issue #13)")
        if not write_block("transfer", text + (f"\n\n![chart](plots/{PLOT.name})" if made else "")):
            return 2
    wrong = [r for r in result["rows"] if r["verified"] is False]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
