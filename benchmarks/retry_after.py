"""Do clients that obey Retry-After get in when they come back? Our conductor with its retry
book (requests refused together are told to come back one after another) against the same
conductor telling each refusal its own drain (`--no-retry-spacing`), measured in one run.

    python benchmarks/retry_after.py --rates 0.6,1.2 --requests 40

Each arm starts `mooncake serve` (1 prefill + 1 decode worker) and runs `mooncake bench
--retry-after` (same prompts, same Poisson arrivals; latency counts from the first attempt; a
request whose waits would pass --max-retry-wait gives up and counts as refused). Prints per rate:
retries sent, how many were refused again, requests that gave up, SLO
attainment and goodput. Writes the bench records to benchmarks/out/retry-after/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import servers  # noqa: E402
from mooncake.bench import cli as bench_cli  # noqa: E402
from mooncake.model import ensure_model  # noqa: E402

ARMS = {"spaced": [], "alone": ["--no-retry-spacing"]}


def retry_figures(requests: list[dict]) -> dict:
    """From one rate's bench records: attempts beyond the first (retries), those refused again,
    and the requests that were refused at least once and then gave up."""
    retries = refused_again = gave_up = refused_once = 0
    for r in requests:
        attempts = r["attempts"]
        refused_attempts = attempts if r["status"] == "refused" else attempts - 1
        if refused_attempts == 0:
            continue
        refused_once += 1
        retries += attempts - 1
        refused_again += refused_attempts - 1
        gave_up += r["status"] == "refused"
    return {"refused_once": refused_once, "retries": retries, "refused_again": refused_again, "gave_up": gave_up}


def measure(args: argparse.Namespace, arm: str, model: str, out_dir: Path) -> list[dict] | None:
    out = out_dir / f"{arm}.json"
    extra = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo), *ARMS[arm]]
    argv = ["--model", servers.MODEL_NAME, "--num-requests", str(args.requests), "--input-len", args.input_len,
            "--output-len", str(args.output_len), "--seed", str(args.seed), "--rates", args.rates,
            "--warmup", str(args.warmup), "--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo),
            "--retry-after", "--max-retry-wait", str(args.max_retry_wait), "--out", str(out)]
    with servers.mooncake_cluster(model, out_dir / "logs" / arm, extra=extra, dtype=args.dtype) as url:
        code = bench_cli.main(["--url", url, *argv])
    if code != 0 or not out.exists():
        print(f"[{arm}] mooncake bench exited with {code}", file=sys.stderr)
        return None
    rows = []
    for run in json.loads(out.read_text())["runs"]:
        s = run["summary"]
        rows.append({"rate": s["offered_rate"], "attainment": s["attainment"], "goodput": s["goodput"],
                     **retry_figures(run["requests"])})
    return rows


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    lines = [f"{args.requests} requests per rate, prompts {args.input_len} tokens, {args.output_len} output tokens, "
             f"{args.dtype}; SLO TTFT <= {args.ttft_slo} s, mean TBT <= {args.tbt_slo} s; clients obey Retry-After "
             f"for up to {args.max_retry_wait:g} s in all", "",
             "| rate (req/s) | arm | refused at least once | retries | refused again | gave up | attainment | goodput |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, rows in results.items():
        for r in rows:
            again = f"{r['refused_again']} ({100 * r['refused_again'] / r['retries']:.0f} %)" if r["retries"] else "0"
            lines.append(f"| {r['rate']:g} | {arm} | {r['refused_once']} | {r['retries']} | {again} | {r['gave_up']} "
                         f"| {100 * r['attainment']:.0f} % | {r['goodput']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, from {tuple(ARMS)}")
    p.add_argument("--rates", default="0.6,1.2", help="offered rates in req/s (overload, where refusals happen)")
    p.add_argument("--requests", type=int, default=40, help="requests per rate")
    p.add_argument("--input-len", default="1000-3000", help="prompt tokens, MIN-MAX")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4, help="requests before measuring (calibration warms up)")
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.25)
    p.add_argument("--max-retry-wait", type=float, default=30.0, help="seconds a client waits for retries in all")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := [a for a in arms if a not in ARMS]:
        p.error(f"unknown arms {unknown}; choose from {tuple(ARMS)}")
    model = str(ensure_model())
    out_dir = ROOT / "benchmarks" / "out" / "retry-after"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for arm in arms:
        rows = measure(args, arm, model, out_dir)
        if rows is not None:
            results[arm] = rows
    print(report(results, args))
    return 0 if len(results) == len(arms) else 1


if __name__ == "__main__":
    sys.exit(main())
