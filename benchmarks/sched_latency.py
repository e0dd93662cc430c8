"""Scheduling decision latency (p50/p99) and simulator speed.

  PYTHONPATH=. .venv/bin/python benchmarks/sched_latency.py [--iters 200] [--sim-trace PATH]

Setup: a global prefix index of 10^6 blocks (random 128-bit keys spread over the prefill
instances, plus the request's own prefix held to various depths by 1/8 of them); half the
instances prefill with random queues, half decode with 32 running sequences each; block
size 16 (vLLM's); policy kvcache-centric with prediction admission (the most work per
decision). Hashing the prompt is timed separately: the conductor does it once per request.
Goal: p99 < 1 ms at 16 instances, < 10 ms at 1,024.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import random
import sys
import time

import numpy as np

from conductor.core import (ClusterState, DecodeSeq, Estimators, InstanceState, PrefixIndex, Request, Role, Scheduler,
                            SchedulerConfig, load_profile)
from mooncake.hashing import hash_prompt_blocks

RELEASED_TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared/traces/synthetic_trace.jsonl"

BLOCK = 16
INDEX_BLOCKS = 1_000_000
GOALS_MS = {16: 1.0, 128: None, 1024: 10.0}


def build(n_instances: int, prompt_tokens: int, rng: random.Random):
    tokens = np.array([rng.randrange(50_000) for _ in range(prompt_tokens)], dtype=np.uint32)
    keys = hash_prompt_blocks(tokens, BLOCK, ("bench",))
    n_p = n_instances // 2
    prefill = [InstanceState(f"p{i}", Role.PREFILL, queued_prefill_s=rng.uniform(0, 5), bandwidth_Bps=50e9,
                             pending_send_bytes=rng.uniform(0, 1e9)) for i in range(n_p)]
    decode = [InstanceState(f"d{i}", Role.DECODE, running=tuple(DecodeSeq(rng.uniform(0, 50), rng.randrange(500, 20_000))
                                                                for _ in range(32)),
                            kv_capacity_tokens=1_400_000) for i in range(n_instances - n_p)]
    index = PrefixIndex()
    per = (INDEX_BLOCKS - len(keys)) // n_p
    for i, inst in enumerate(prefill):
        index.apply_stored(inst.instance_id, (rng.getrandbits(128) for _ in range(per)))
    for inst in prefill[:: 8]:  # 1/8 of them hold the request's prefix, to random depths
        index.apply_stored(inst.instance_id, keys[: rng.randrange(1, len(keys) + 1)])
    return keys, ClusterState(tuple(prefill + decode), index, mean_decode_s=30.0)


def bench(n_instances: int, prompt_tokens: int, iters: int, est: Estimators, flexible: bool = False) -> dict:
    rng = random.Random(n_instances * 7 + prompt_tokens)
    keys, state = build(n_instances, prompt_tokens, rng)
    # The index is a 10^6-entry dict that the cyclic GC would rescan on every full collection
    # (a 100+ ms pause); the live conductor should freeze long-lived state the same way.
    gc.collect()
    gc.freeze()
    sched = Scheduler(SchedulerConfig(block_size=BLOCK, ttft_slo_s=1e6, flexible_roles=flexible), est)
    req = Request("r", prompt_tokens, tuple(keys))
    lat = []
    for i in range(iters):
        t = time.perf_counter()
        sched.schedule(req, state, now=60.0 + i)
        lat.append(time.perf_counter() - t)
    tokens = np.arange(prompt_tokens, dtype=np.uint32)
    hash_t = min(_timed(lambda: hash_prompt_blocks(tokens, BLOCK)) for _ in range(5))
    lat_ms = np.array(lat) * 1e3
    gc.unfreeze()
    return {"instances": n_instances, "prompt": prompt_tokens, "index_blocks": len(state.index),
            "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
            "hash_ms": hash_t * 1e3}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def sim_speed(trace_path: str) -> dict:
    from conductor.sim.cli import simulate
    from conductor.sim.trace import load_trace

    trace = load_trace(trace_path)
    res = simulate(trace, SchedulerConfig(), load_profile("paper-70b-8gpu"))
    return {"trace": trace_path, "requests": len(trace), "wall_s": res.wall_s,
            "sim_requests_per_s": len(trace) / res.wall_s, "simulated_s": res.makespan_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200, help="decisions timed per configuration")
    ap.add_argument("--sim-trace", default=str(RELEASED_TRACE),
                    help="trace for the simulator-speed figure")
    ap.add_argument("--flexible-roles", action="store_true",
                    help="time decisions with flexible roles (the live cluster's default): every instance "
                         "is a prefill and a decode candidate")
    args = ap.parse_args(argv)
    est = Estimators.from_profile(load_profile("paper-70b-8gpu"))
    print("| instances | prompt tokens | index blocks | p50 ms | p99 ms | goal p99 | hash ms |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for n in (16, 128, 1024):
        for prompt in (8192, 131072):
            r = bench(n, prompt, args.iters, est, args.flexible_roles)
            goal = GOALS_MS[n]
            verdict = "" if goal is None else (f"< {goal:g} ms " + ("met" if r["p99_ms"] < goal else "MISSED"))
            ok &= goal is None or r["p99_ms"] < goal
            print(f"| {n} | {prompt} | {r['index_blocks']:,} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {verdict} "
                  f"| {r['hash_ms']:.2f} |", flush=True)
    s = sim_speed(args.sim_trace)
    print(f"\nsimulator: {s['requests']} requests ({s['simulated_s']:.0f} simulated s, 8P+8D, kvcache-centric/"
          f"prediction) in {s['wall_s']:.2f} s wall = {s['sim_requests_per_s']:.0f} simulated requests/s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
