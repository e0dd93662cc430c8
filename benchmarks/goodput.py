"""Requests served within SLO on the same cores: our cluster against stock vLLM and against vLLM
with its own MooncakeConnector, measured in one run (issue #12's comparison).

    python benchmarks/goodput.py --dtype bfloat16 --rates 0.25,0.5,1.0 --requests 40

Each system is started by this script, measured alone with `mooncake bench` (same prompts, same
Poisson arrivals at every rate, refusals counted as misses), and stopped before the next starts:
- vllm:            one stock vLLM OpenAI server on every core (no connector, no disaggregation);
- ours:            `mooncake serve` (1 prefill + 1 decode worker, one core each), started with the
                   SLOs it is judged by;
- vllm-mooncake:   vLLM's own MooncakeConnector, 1 prefill + 1 decode (one core each) behind a
                   proxy (benchmarks/peers/), when it can be installed here.
Prints attainment, goodput and refusals per rate, each system's SLO capacity (the highest offered
rate with >= 90 % attainment), and our ratios to each peer. Writes the raw records to
benchmarks/out/goodput-<dtype>/ and a plot to benchmarks/plots/goodput_<dtype>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import servers  # noqa: E402
from mooncake.bench import cli as bench_cli  # noqa: E402
from mooncake.model import ensure_model  # noqa: E402

SYSTEMS = ("vllm", "ours", "vllm-mooncake")


def system(name: str, model: str, log_dir: Path, dtype: str, ttft_slo: float, tbt_slo: float,
           ours_args: tuple[str, ...] = ()):
    if name == "vllm":
        return servers.colocated_vllm(model, log_dir, dtype=dtype)
    if name == "ours":
        return servers.mooncake_cluster(model, log_dir, dtype=dtype,
                                        extra=["--ttft-slo", str(ttft_slo), "--tbt-slo", str(tbt_slo), *ours_args])
    if name == "vllm-mooncake":
        return servers.vllm_mooncake_pd(model, log_dir, dtype=dtype)
    raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")


def bench_argv(args: argparse.Namespace, url: str, out: Path) -> list[str]:
    return ["--url", url, "--model", servers.MODEL_NAME, "--num-requests", str(args.requests),
            "--input-len", args.input_len, "--output-len", str(args.output_len), "--seed", str(args.seed),
            "--rates", args.rates, "--warmup", str(args.warmup), "--ttft-slo", str(args.ttft_slo),
            "--tbt-slo", str(args.tbt_slo), "--out", str(out)]


def measure(args: argparse.Namespace, name: str, model: str, out_dir: Path) -> dict | None:
    out = out_dir / f"{name}.json"
    try:
        with system(name, model, out_dir / "logs", args.dtype, args.ttft_slo, args.tbt_slo,
                    tuple(shlex.split(args.ours_args))) as url:
            code = bench_cli.main(bench_argv(args, url, out))
            routes = route_counts(url) if name == "ours" else None
    except Exception as exc:  # noqa: BLE001 - a peer that cannot start is reported, the run goes on
        print(f"[{name}] could not be measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    if code != 0 or not out.exists():
        print(f"[{name}] mooncake bench exited with {code}", file=sys.stderr)
        return None
    doc = json.loads(out.read_text())
    return {"slo_capacity": doc["slo_capacity"], "summaries": [run["summary"] for run in doc["runs"]],
            "routes": routes}


def route_counts(api_url: str) -> dict[str, float] | None:
    """Our conductor's requests routed by kind over the whole run, warm-up included (its
    mooncake_routes_total): how often a worker played against its label. None if unreadable."""
    try:
        return routes_from_metrics(httpx.get(api_url.removesuffix("/v1") + "/metrics", timeout=10).text)
    except httpx.HTTPError:
        return None


def routes_from_metrics(text: str) -> dict[str, float]:
    return {s.labels["kind"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "mooncake_routes" for s in family.samples if s.name == "mooncake_routes_total"}


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{a / b:.2f}x" if b > 0 else ("inf" if a > 0 else "n/a")


def report(results: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"dtype {args.dtype}; {args.requests} requests per rate, prompts {args.input_len} tokens, "
             f"{args.output_len} output tokens; SLO TTFT <= {args.ttft_slo} s, mean TBT <= {args.tbt_slo} s",
             "", "| rate (req/s) | " + " | ".join(f"{n}: attainment / goodput / refused" for n in results) + " |",
             "|---|" + "---|" * len(results)]
    by_rate: dict[float, dict[str, dict]] = {}
    for name, res in results.items():
        for s in res["summaries"]:
            by_rate.setdefault(s["offered_rate"], {})[name] = s
    for rate in sorted(by_rate):
        cells = []
        for name in results:
            s = by_rate[rate].get(name)
            cells.append("-" if s is None else f"{100 * s['attainment']:.0f} % / {s['goodput']:.3f} / {s['refused']}")
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    lines.append("")
    caps = {name: res.get("slo_capacity") for name, res in results.items()}
    lines.append("SLO capacity (req/s, highest rate with >= 90 % attainment): "
                 + ", ".join(f"{n} {c if c is not None else 'none'}" for n, c in caps.items()))
    if "ours" in results:
        for peer in (n for n in results if n != "ours"):
            worst = min((by_rate[r]["ours"]["goodput"] / by_rate[r][peer]["goodput"]
                         for r in by_rate if "ours" in by_rate[r] and peer in by_rate[r]
                         and by_rate[r][peer]["goodput"] > 0), default=None)
            lines.append(f"ours vs {peer}: SLO capacity {ratio(caps['ours'], caps[peer])}; lowest goodput ratio "
                         f"over the rates {'n/a' if worst is None else f'{worst:.2f}x'}")
        lines += calibration_lines(results["ours"]["summaries"], args.ttft_slo)
        if results["ours"].get("routes"):
            lines.append("ours: requests routed over the run (warm-up included): " + ", ".join(
                f"{kind} {count:.0f}" for kind, count in sorted(results["ours"]["routes"].items())))
    return "\n".join(lines)


def calibration_lines(summaries: list[dict], ttft_slo: float) -> list[str]:
    """Ours only: how measured TTFT compares with what the conductor predicted (after the
    warm-up; 0.85-1.15 is #12's goal), and refusals at rates where served TTFT p99 stayed under
    half the SLO (spurious: #12 asks for none)."""
    out = []
    for s in summaries:
        r, p99 = s.get("ttft_over_predicted") or {}, s["ttft_s"]["p99"]
        calibrated = f"p50 {r['p50']:.2f} (p10 {r['p10']:.2f}, p90 {r['p90']:.2f}, {r['n']} requests)" if r else "n/a"
        spurious = s["refused"] if p99 is not None and p99 < ttft_slo / 2 else 0
        out.append(f"ours at {s['offered_rate']:g} req/s: measured / predicted TTFT {calibrated}; "
                   f"served TTFT p99 {'-' if p99 is None else f'{p99:.2f} s'}, refusals under half the SLO: {spurious}")
    return out


def plot(results: dict[str, dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for name, res in results.items():
        rates = [s["offered_rate"] for s in res["summaries"]]
        a1.plot(rates, [100 * s["attainment"] for s in res["summaries"]], marker="o", label=name)
        a2.plot(rates, [s["goodput"] for s in res["summaries"]], marker="o", label=name)
    a1.axhline(90, color="grey", linestyle=":", label="90 % target")
    a1.set(xlabel="offered rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    a2.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s within SLO)")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Same 2 cores, {args.dtype}: TTFT <= {args.ttft_slo} s, mean TBT <= {args.tbt_slo} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {SYSTEMS}")
    p.add_argument("--rates", default="0.25,0.5,1.0", help="offered rates in req/s")
    p.add_argument("--requests", type=int, default=40, help="requests per rate")
    p.add_argument("--input-len", default="1000-3000", help="prompt tokens, MIN-MAX")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4, help="requests before measuring (calibration warms up)")
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours-args", default="", help="more `mooncake serve` options for ours, e.g. "
                                                   "\"--decode-chunk-size 2048\" (default: none)")
    args = p.parse_args()
    model = str(ensure_model())
    out_dir = ROOT / "benchmarks" / "out" / f"goodput-{args.dtype}"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.systems.split(","):
        res = measure(args, name.strip(), model, out_dir)
        if res is not None:
            results[name.strip()] = res
    text = report(results, args)
    print(text)
    (out_dir / "report.md").write_text(text + "\n")
    with contextlib.suppress(Exception):
        plot(results, ROOT / "benchmarks" / "plots" / f"goodput_{args.dtype}.png", args)
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
