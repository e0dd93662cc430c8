"""TTFT, time between tokens and end-to-end latency: the disaggregated cluster against a
colocated vLLM server of the same model on the same machine, measured in the same run.

    python benchmarks/spine_latency.py --requests 16 --output-tokens 64

Each system is started, measured alone (so they do not share the cores while measured), and
stopped. Prompts are random token ids (no prefix-cache hits on either side), lengths spread
evenly over [--min-len, --max-len]. With --rate R, arrivals are Poisson at R req/s; otherwise
requests are sent one after another. Prints p50/p90 of each metric for each system, SLO
attainment and goodput (requests within both SLOs per second of the run), and the ratio to the
colocated server (below 1: faster, for latencies; above 1: better, for goodput).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.servers import MODEL_NAME, colocated_vllm, mooncake_cluster  # noqa: E402


@dataclass
class Sample:
    prompt_len: int
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0
    error: str | None = None


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    rng.shuffle(lengths)
    return [[rng.randrange(1000, 40000) for _ in range(L)] for L in lengths]


async def one(client: openai.AsyncOpenAI, prompt: list[int], out_tokens: int) -> Sample:
    s = Sample(len(prompt))
    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=out_tokens,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if not chunk.choices or not chunk.choices[0].text:
                continue
            now = time.perf_counter()
            if s.tokens == 0:
                s.ttft = now - start
            else:
                s.gaps.append(now - last)
            last = now
            s.tokens += 1
        s.e2e = time.perf_counter() - start
    except openai.OpenAIError as exc:
        s.error = str(exc)
    return s


async def run_load(base_url: str, prompts: list[list[int]], out_tokens: int, rate: float,
                   seed: int) -> tuple[list[Sample], float]:
    """The samples, and the seconds from the first request sent to the last one finished."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    await one(client, prompts[0][:64], 4)  # warm-up, not counted
    start = time.perf_counter()
    if rate <= 0:
        samples = [await one(client, p, out_tokens) for p in prompts]
        wall = time.perf_counter() - start
        await client.close()
        return samples, wall
    rng = random.Random(seed)
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(one(client, p, out_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    samples = list(await asyncio.gather(*tasks))
    wall = time.perf_counter() - start
    await client.close()  # inside this loop: asyncio.run closes it next
    return samples, wall


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def within_slo(s: Sample, ttft_slo: float, tbt_slo: float) -> bool:
    """Paper's goodput criterion: TTFT within its SLO and the mean time between tokens within its."""
    return s.error is None and s.ttft <= ttft_slo and (not s.gaps or statistics.mean(s.gaps) <= tbt_slo)


def summarize(samples: list[Sample], wall_s: float, ttft_slo: float, tbt_slo: float) -> dict:
    ok = [s for s in samples if s.error is None]
    gaps = [g for s in ok for g in s.gaps]
    good = sum(within_slo(s, ttft_slo, tbt_slo) for s in samples)
    return {"ok": len(ok), "errors": len(samples) - len(ok), "wall_s": wall_s,
            "slo_attainment": good / len(samples) if samples else float("nan"),
            "goodput_rps": good / wall_s if wall_s > 0 else float("nan"),
            "ttft_p50": pct([s.ttft for s in ok], 0.5), "ttft_p90": pct([s.ttft for s in ok], 0.9),
            "tbt_p50": pct(gaps, 0.5), "tbt_p90": pct(gaps, 0.9),
            "e2e_p50": pct([s.e2e for s in ok], 0.5), "e2e_p90": pct([s.e2e for s in ok], 0.9),
            "tbt_max": max(gaps, default=float("nan")),
            "mean_tokens": statistics.mean([s.tokens for s in ok]) if ok else 0}


def ratio(ours: float, peer: float) -> float:
    """ours / peer; inf when only the peer is 0 (e.g. its goodput), nan when both are."""
    if peer == 0:
        return float("inf") if ours > 0 else float("nan")
    return ours / peer


def route_counts(base_url: str) -> dict[str, int]:
    """How the conductor routed the requests (disaggregated or colocated), from its /metrics."""
    text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("mooncake_routes_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            counts[kind] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests per system")
    ap.add_argument("--min-len", type=int, default=128, help="shortest prompt (tokens)")
    ap.add_argument("--max-len", type=int, default=2048, help="longest prompt (tokens)")
    ap.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrival rate (req/s); 0 = one at a time")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model folder (default: prepared SmolLM2-135M)")
    ap.add_argument("--log-dir", default="benchmarks/out/logs", help="server logs go here")
    ap.add_argument("--also-always-disaggregate", action="store_true",
                    help="also measure the cluster with --no-conditional-disaggregation (every request P then D), "
                         "to show what deciding per request buys")
    ap.add_argument("--ttft-slo", type=float, default=10.0, help="TTFT SLO for goodput (seconds)")
    ap.add_argument("--tbt-slo", type=float, default=0.1, help="mean time-between-tokens SLO for goodput (seconds)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)

    from mooncake.model import ensure_model

    model = args.model or str(ensure_model())
    prompts = make_prompts(args.requests, args.min_len, args.max_len, args.seed)
    results = {}
    log_dir = Path(args.log_dir)

    def measure(url: str) -> dict:
        samples, wall = asyncio.run(run_load(url, prompts, args.output_tokens, args.rate, args.seed))
        return summarize(samples, wall, args.ttft_slo, args.tbt_slo)

    # The cluster is told the SLOs it is judged by: it refuses (429) what it predicts would miss them.
    slos = ["--ttft-slo", str(args.ttft_slo), "--tbt-slo", str(args.tbt_slo)]
    systems = [("mooncake", slos)]
    if args.also_always_disaggregate:
        systems.append(("mooncake always P->D", [*slos, "--no-conditional-disaggregation"]))
    for name, extra in systems:
        with mooncake_cluster(model, log_dir, extra=extra, dtype=args.dtype) as url:
            results[name] = measure(url)
            results[name]["routes"] = route_counts(url)
    with colocated_vllm(model, log_dir, dtype=args.dtype) as url:
        results["colocated"] = measure(url)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{args.requests} requests, prompts {args.min_len}-{args.max_len} tokens, {args.output_tokens} output "
          f"tokens, {'rate %.2f req/s' % args.rate if args.rate > 0 else 'sequential'}, {args.dtype}; "
          f"SLO: TTFT <= {args.ttft_slo:g} s, mean TBT <= {args.tbt_slo:g} s")
    c = results["colocated"]
    names = list(results)
    print(f"{'metric':<16}" + "".join(f"{n:>22}" for n in names) + "".join(f"{'ratio ' + n[:14]:>22}" for n in names[:-1]))
    for key in ("ttft_p50", "ttft_p90", "tbt_p50", "tbt_p90", "tbt_max", "e2e_p50", "e2e_p90",
                "slo_attainment", "goodput_rps"):
        unit = "" if key in ("slo_attainment", "goodput_rps") else "s"
        row = "".join(f"{results[n][key]:>21.3f}{unit or ' '}" for n in names)
        row += "".join(f"{ratio(results[n][key], c[key]):>22.2f}" for n in names[:-1])
        print(f"{key:<16}{row}")
    print("errors (429 refusals included): " + ", ".join(f"{n} {results[n]['errors']}" for n in names))
    for n in names[:-1]:
        routes = ", ".join(f"{kind} {k}" for kind, k in sorted(results[n]["routes"].items())) or "none counted"
        print(f"{n} routes (incl. warm-up): {routes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
