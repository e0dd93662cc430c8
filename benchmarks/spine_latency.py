"""TTFT, time between tokens and end-to-end latency: the disaggregated cluster against a
colocated vLLM server of the same model on the same machine, measured in the same run.

    python benchmarks/spine_latency.py --requests 16 --output-tokens 64

Each system is started, measured alone (so they do not share the cores while measured), and
stopped. Prompts are random token ids (no prefix-cache hits on either side), lengths spread
evenly over [--min-len, --max-len]. With --rate R, arrivals are Poisson at R req/s; otherwise
requests are sent one after another. Prints p50/p90 of each metric for both and the ratio
(mooncake / colocated; below 1 means mooncake is faster).
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


async def run_load(base_url: str, prompts: list[list[int]], out_tokens: int, rate: float, seed: int) -> list[Sample]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    await one(client, prompts[0][:64], 4)  # warm-up, not counted
    if rate <= 0:
        return [await one(client, p, out_tokens) for p in prompts]
    rng = random.Random(seed)
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(one(client, p, out_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.error is None]
    gaps = [g for s in ok for g in s.gaps]
    return {"ok": len(ok), "errors": len(samples) - len(ok),
            "ttft_p50": pct([s.ttft for s in ok], 0.5), "ttft_p90": pct([s.ttft for s in ok], 0.9),
            "tbt_p50": pct(gaps, 0.5), "tbt_p90": pct(gaps, 0.9),
            "e2e_p50": pct([s.e2e for s in ok], 0.5), "e2e_p90": pct([s.e2e for s in ok], 0.9),
            "tbt_max": max(gaps, default=float("nan")),
            "mean_tokens": statistics.mean([s.tokens for s in ok]) if ok else 0}


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
    ap.add_argument("--always-disaggregate", action="store_true",
                    help="start the conductor with --no-conditional-disaggregation (every request P then D)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)

    from mooncake.model import ensure_model

    model = args.model or str(ensure_model())
    prompts = make_prompts(args.requests, args.min_len, args.max_len, args.seed)
    results = {}
    log_dir = Path(args.log_dir)
    extra = ["--no-conditional-disaggregation"] if args.always_disaggregate else []
    with mooncake_cluster(model, log_dir, extra=extra, dtype=args.dtype) as url:
        results["mooncake"] = summarize(asyncio.run(run_load(url, prompts, args.output_tokens, args.rate, args.seed)))
        results["mooncake"]["routes"] = route_counts(url)
    with colocated_vllm(model, log_dir, dtype=args.dtype) as url:
        results["colocated"] = summarize(asyncio.run(run_load(url, prompts, args.output_tokens, args.rate, args.seed)))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    m, c = results["mooncake"], results["colocated"]
    print(f"{args.requests} requests, prompts {args.min_len}-{args.max_len} tokens, {args.output_tokens} output "
          f"tokens, {'rate %.2f req/s' % args.rate if args.rate > 0 else 'sequential'}, {args.dtype}")
    print(f"{'metric':<10}{'mooncake 1P+1D':>16}{'colocated vLLM':>16}{'ratio':>8}")
    for key in ("ttft_p50", "ttft_p90", "tbt_p50", "tbt_p90", "tbt_max", "e2e_p50", "e2e_p90"):
        print(f"{key:<10}{m[key]:>15.3f}s{c[key]:>15.3f}s{m[key] / c[key]:>8.2f}")
    print(f"errors: mooncake {m['errors']}, colocated {c['errors']}")
    routes = ", ".join(f"{kind} {n}" for kind, n in sorted(m["routes"].items())) or "none counted"
    print(f"mooncake routes (incl. warm-up): {routes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
