"""How many requests per second these cores can serve at all, for issue #12's workload: the
ceiling under every system's SLO capacity, measured with the engine itself in one run.

    python benchmarks/compute_ceiling.py --dtype bfloat16

One stock vLLM server at a time sends issue #12's prompts (the same generator and lengths as
benchmarks/goodput.py, 64 output tokens, ignore_eos) one after another: no queue, no batching.
- on every core, as the colocated peer runs: prefill seconds per prompt (its TTFT) and decode
  seconds (last token - first token);
- on one core, as each of our workers runs: the same.
Whatever the scheduler, a request needs its prompt prefilled by some engine. With decode free, n
cores serve at most max(T_all, n T_one) / L requests per second (T_all: prompt tokens/s of one
engine on all n cores, T_one: on one core, n engines side by side; L: the workload's mean
prompt). That is the ceiling printed, with the decode measured at batch 1 beside it (an upper
bound of its cost: batching lowers it).

With --goodput-dir (default benchmarks/out/goodput-<dtype>, what goodput.py last wrote), each
system's SLO capacity from that run is printed as a share of the ceiling, with what 1.3x the
colocated vLLM's would need. A rate at or above the ceiling cannot keep 90 % of TTFTs within
any SLO: the queue of prompts grows without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import servers  # noqa: E402
from mooncake.bench import runner, workload  # noqa: E402
from mooncake.bench.stats import OK, RequestRecord  # noqa: E402
from mooncake.model import ensure_model  # noqa: E402

SALT = 7919  # prompts unlike any goodput.py run's, so no server has them cached


@dataclass(frozen=True)
class EngineSpeed:
    cores: int
    prefill_s: float
    """Mean seconds from sending a prompt to its first token, nothing else running."""
    decode_s: float
    """Mean seconds from the first token to the last, batch of one."""
    prompt_tokens: float
    """Mean prompt length of the measured requests."""

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s


def ceiling_rps(all_cores: EngineSpeed, one_core: EngineSpeed, cores: int, mean_prompt: float) -> float:
    """Requests/s of `mean_prompt`-token prompts the cores could prefill with decode free: one
    engine on all of them, or one engine per core side by side, whichever prefills more. By
    tokens/s, so a measured sample whose prompts ran short or long of the workload's mean does
    not move it."""
    return max(all_cores.tokens_per_s, cores * one_core.tokens_per_s) / mean_prompt


def share_lines(capacities: dict[str, float | None], ceiling: float, goal: float = 1.3) -> list[str]:
    lines = []
    for name, cap in capacities.items():
        if cap is None:
            lines.append(f"- {name}: no rate reached 90 % attainment in that run")
        else:
            lines.append(f"- {name}: SLO capacity {cap:g} req/s = {cap / ceiling:.2f} of the ceiling")
    peer = capacities.get("vllm")
    if peer:
        need = goal * peer
        verdict = "at or above the ceiling: cannot be met" if need >= ceiling else "below the ceiling"
        lines.append(f"- {goal:g}x the colocated vLLM's capacity = {need:.3g} req/s = "
                     f"{need / ceiling:.2f} of the ceiling ({verdict}, before any decode work)")
    return lines


async def measure(url: str, prompts: list[list[int]], output_len: int, warmup: int) -> list[RequestRecord]:
    opts = runner.ClientOptions(base_url=url, model=servers.MODEL_NAME)
    client = runner.make_client(opts)
    await runner.preflight(client, opts.model)
    records = []
    for i, prompt in enumerate(prompts):
        rec = RequestRecord(i, len(prompt), output_len, 0.0, warmup=i < warmup)
        await runner.send_one(client, opts, prompt, rec, 0.0)
        if rec.status != OK:
            raise RuntimeError(f"request {i} failed: {rec.error}")
        records.append(rec)
    return records


def speed(records: list[RequestRecord], cores: int) -> EngineSpeed:
    timed = [r for r in records if not r.warmup]
    return EngineSpeed(cores, statistics.mean(r.ttft_s for r in timed),
                       statistics.mean(r.chunk_s[-1] - r.chunk_s[0] for r in timed),
                       statistics.mean(r.input_length for r in timed))


def capacities(goodput_dir: Path) -> dict[str, float | None]:
    found = {}
    for name in ("vllm", "ours", "vllm-mooncake"):
        path = goodput_dir / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text()).get("slo_capacity")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--requests", type=int, default=10, help="prompts per engine, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="leading prompts not counted")
    p.add_argument("--input-len", default="1000-3000", help="prompt tokens, MIN-MAX (as goodput.py)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput-dir", type=Path, default=None,
                   help="goodput.py's output folder whose SLO capacities to compare (default: "
                        "benchmarks/out/goodput-<dtype>)")
    args = p.parse_args()
    if not 0 <= args.warmup < args.requests:
        p.error("--warmup must be >= 0 and below --requests")
    lo, hi = (int(x) for x in args.input_len.split("-"))
    specs = workload.generated_specs(args.requests, (lo, hi), args.output_len, args.seed)
    prompts = [workload.prompt_of(s, block_size=512, vocab_size=49152, seed=args.seed, salt=SALT) for s in specs]
    model = str(ensure_model())
    mine = sorted(os.sched_getaffinity(0))
    out_dir = ROOT / "benchmarks" / "out"
    speeds = {}
    for label, cores in (("all", f"{mine[0]}-{mine[-1]}"), ("one", str(mine[0]))):
        with servers.colocated_vllm(model, out_dir / "logs", dtype=args.dtype, cores=cores) as url:
            records = asyncio.run(measure(url, prompts, args.output_len, args.warmup))
        speeds[label] = speed(records, len(mine) if label == "all" else 1)
    mean_prompt = (lo + hi) / 2  # the workload's mean (goodput.py's prompts are uniform in [lo, hi])
    ceiling = ceiling_rps(speeds["all"], speeds["one"], len(mine), mean_prompt)
    lines = [f"## Compute ceiling, {args.dtype}, {len(mine)} cores, prompts of {args.input_len} tokens "
             f"(the workload's mean {mean_prompt:.0f}; the measured ones' {speeds['all'].prompt_tokens:.0f}), "
             f"{args.output_len} output tokens",
             "", "| engine | prefill s per prompt | prompt tokens/s | decode s per request (batch 1) |",
             "|---|---|---|---|"]
    for label, s in speeds.items():
        lines.append(f"| vLLM on {s.cores} core{'s' if s.cores > 1 else ''} | {s.prefill_s:.2f} | "
                     f"{s.tokens_per_s:.0f} | {s.decode_s:.2f} |")
    lines += ["", f"Ceiling with decode free: {ceiling:.3g} req/s of {mean_prompt:.0f}-token prompts (one engine "
                  f"on all cores: {speeds['all'].tokens_per_s / mean_prompt:.3g}; one per core: "
                  f"{len(mine) * speeds['one'].tokens_per_s / mean_prompt:.3g})"]
    goodput_dir = args.goodput_dir or out_dir / f"goodput-{args.dtype}"
    caps = capacities(goodput_dir)
    if caps:
        lines += ["", f"SLO capacities from {goodput_dir.relative_to(ROOT) if goodput_dir.is_relative_to(ROOT) else goodput_dir}:"]
        lines += share_lines(caps, ceiling)
    text = "\n".join(lines)
    print(text)
    (out_dir / f"compute_ceiling-{args.dtype}.json").write_text(json.dumps(
        {"speeds": {k: asdict(v) for k, v in speeds.items()}, "mean_prompt_tokens": mean_prompt,
         "ceiling_rps": ceiling, "capacities": caps,
         "report": text}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
