"""The KV path on a GPU, at a real model's KV geometry, beside the physical limits of the same
machine measured in the same run.

    python -m benchmarks.kv_path_cuda                  # Llama-3.1-8B's KV, 8k-token prompts
    python -m benchmarks.kv_path_cuda --tokens 32768 --transports shm

The prefill side's paged cache and the decode side's are CUDA tensors on one device. The
connector's two halves (prefill/kv_sender.py, decode/kv_receiver.py), each on its own transfer
engine, move a prompt's blocks in chunks as vLLM's steps would: the sender gathers each layer's
rows into pinned host memory on a side stream, the engine writes them into the decode worker's
staging arena (tcp or shm, checksums on, as shipped), and the receiver lands each layer with one
host-to-device copy. No vLLM runs here: its CUDA build and a model of the size cannot travel to
the device machine this was written for, so the engine steps are driven by hand.

Two modes per configuration:
- burst: every layer of every chunk is saved at once (no compute): the pipeline's throughput,
  against the slowest stage's limit measured here (device-to-host copy, the transport alone);
- overlapped: each layer's save follows that layer's emulated prefill compute (a matmul of a
  Llama-8B layer's FLOPs for the chunk's tokens), as in the paper's Figure 5; the figure is the
  exposed tail, the time from the last layer's compute to the last byte landed in staging.

Both engines and the emulated forward share one Python process (and its GIL): a conservative
setting for the sender, whose thread competes with the receiving engine's threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadSpec
from decode.staging import StagingConfig
from messenger.api import Slice
from messenger.engine import EngineConfig, TransferEngine
from mooncake.kv_layout import block_bytes, blocks_first
from prefill.kv_sender import KVSender
from prefill.push_planner import SaveSpec

GB = 1e9


def geometry_parser(doc: str) -> argparse.ArgumentParser:
    """The options both GPU benchmarks share: the KV geometry (Llama-3.1-8B's by default), the
    prompt length and the device."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--layers", type=int, default=32, help="attention layers (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head size (Llama-3.1-8B: 128)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (vLLM's CUDA default: 16)")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens moved per request")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the same path on host caches (a smoke "
                   "test: no pinned memory, no host-device limits)")
    p.add_argument("--out", help="also write the results as JSON here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = geometry_parser(__doc__)
    p.add_argument("--chunk-tokens", type=int, default=2048, help="prefill chunk (vLLM's token budget per step)")
    p.add_argument("--layer-gflop", type=float, default=436.0,
                   help="emulated compute per layer per 1k prompt tokens, GFLOP (Llama-3.1-8B: ~2 x 218M "
                        "parameters per layer = 436)")
    p.add_argument("--repeats", type=int, default=3, help="requests per configuration and mode")
    p.add_argument("--transports", default="tcp,shm", help="comma-separated: tcp, shm")
    p.add_argument("--layouts", default="blocks_first,kv_first",
                   help="cache layouts: blocks_first (vLLM 0.32+), kv_first (older FlashAttention)")
    return p.parse_args(argv)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 3) -> float:
    """Median seconds of fn() after one warm-up, the device synchronized around each run."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def limits(nbytes: int, layers: int, transports: list[str], device: str) -> dict[str, float]:
    """GB/s of each stage alone on this machine, on `nbytes` (one prompt's KV)."""
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    out = {}
    if device == "cuda":
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out = {"d2h_pinned": nbytes / timed(lambda: pinned.copy_(gpu, non_blocking=True)) / GB,
               "h2d_pinned": nbytes / timed(lambda: gpu.copy_(pinned, non_blocking=True)) / GB,
               "h2d_pageable": nbytes / timed(lambda: gpu.copy_(pageable)) / GB}
        del gpu, pinned
    src, dst = pageable.numpy(), np.empty(nbytes, dtype=np.uint8)
    out["host_memcpy"] = nbytes / timed(lambda: np.copyto(dst, src)) / GB
    for transport in transports:
        out[f"{transport}_alone"] = transport_alone(src, dst, layers, transport)
    return out


def transport_alone(src: np.ndarray, dst: np.ndarray, layers: int, transport: str) -> float:
    """Our transfer engine, host to host, one batch per layer, all in flight (as the sender does)."""
    config = EngineConfig(transports=(transport,) if transport == "tcp" else (transport, "tcp"))
    a, b = TransferEngine("limit-a", config), TransferEngine("limit-b", config)
    try:
        a.register("src", src)
        b.register("dst", dst)
        a.start()
        b.start()
        a.add_peer(b.info())
        step = len(src) // layers

        def push():
            batches = [a.write("limit-b", [Slice("src", i * step, "dst", i * step, step)]) for i in range(layers)]
            for batch in batches:
                batch.wait(60)
                if batch.error is not None:
                    raise batch.error
        return len(src) / timed(push) / GB
    finally:
        a.close()
        b.close()


class Emulated:
    """One layer's prefill compute for a chunk: a bf16 matmul of the given FLOPs."""

    def __init__(self, chunk_tokens: int, gflop: float, device: str):
        width = 4096 if device == "cuda" else 64  # on cpu (smoke test) a token amount of work
        cols = max(1, int(gflop * 1e9 / (2 * chunk_tokens * width))) if device == "cuda" else 64
        self.x = torch.randn(chunk_tokens, width, dtype=torch.bfloat16, device=device)
        self.w = torch.randn(width, cols, dtype=torch.bfloat16, device=device)

    def __call__(self) -> None:
        self.x @ self.w


def make_caches(args, layout: str, blocks: int, fill: bool):
    shape = (blocks, 2, args.block_size, args.kv_heads, args.head_dim)
    if layout == "kv_first":
        shape = (2, blocks, *shape[2:])
    make = torch.randn if fill else torch.zeros
    return {f"model.layers.{i}.self_attn.attn": make(shape, dtype=torch.bfloat16, device=args.device)
            for i in range(args.layers)}


def run_config(args, transport: str, layout: str, pin: bool, emulated: Emulated) -> dict:
    n = args.tokens // args.block_size
    blocks = n + 16
    src, dst = make_caches(args, layout, blocks, True), make_caches(args, layout, blocks, False)
    nbytes = n * args.layers * block_bytes(blocks_first(next(iter(src.values())), blocks))
    config = EngineConfig(transports=(transport,) if transport == "tcp" else (transport, "tcp"), timeout_s=60.0)
    c_engine, p_engine = TransferEngine("decode", config), TransferEngine("prefill", config)
    receiver = KVReceiver(c_engine, args.block_size, StagingConfig(capacity_bytes=nbytes + (64 << 20), pin_for_cuda=pin))
    pin_start = time.perf_counter()
    receiver.register_kv_caches(dst, blocks)
    pin_s, pinned = time.perf_counter() - pin_start, receiver.arena_pinned
    c_engine.start(on_notify=receiver.on_notify, on_call=receiver.on_call)
    sender = KVSender(p_engine, timeout_s=60.0)
    sender.register_kv_caches(src, blocks)
    p_engine.start()
    dest = c_engine.info().transports["tcp"]
    chunk_blocks = args.chunk_tokens // args.block_size
    results: dict[str, list[float]] = {"burst_push_s": [], "land_s": [], "overlap_exposed_s": [],
                                       "overlap_compute_s": [], "overlap_push_s": []}
    try:
        for mode in ("burst", "overlapped"):
            for r in range(args.repeats + 1):  # the first of each mode warms up
                req = f"{mode}-{r}"
                src_ids = list(range(n))
                start = time.perf_counter()
                for first in range(0, n, chunk_blocks):
                    ids = tuple(src_ids[first:first + chunk_blocks])
                    spec = SaveSpec(req, "t-" + req, dest, ids, first, 0, n, num_tokens=args.tokens,
                                    final=first + chunk_blocks >= n)
                    for name, cache in src.items():
                        if mode == "overlapped":
                            emulated()
                        sender.save_kv_layer([spec], name, cache)
                    sender.wait_for_save()
                sync()
                compute_end = time.perf_counter()
                outcome = sender.outcome("t-" + req, 120.0)
                pushed = time.perf_counter()
                if outcome != "ok":
                    raise RuntimeError(f"push {req} failed: {outcome}")
                dst_ids = tuple(reversed(range(blocks - n, blocks)))  # other ids, in another order
                receiver.start_load_kv([LoadSpec("d-" + req, "t-" + req, dst_ids, 0, args.tokens, 60.0)])
                land_start = time.perf_counter()
                while True:
                    finished, failed = receiver.collect_loads(set())
                    if finished:
                        break
                sync()
                landed = time.perf_counter()
                if failed:
                    raise RuntimeError(f"landing {req} failed")
                sender.finished_sending({req})
                if r == 0:
                    check(src, dst, blocks, src_ids, dst_ids)
                    continue
                if mode == "burst":
                    results["burst_push_s"].append(pushed - start)
                    results["land_s"].append(landed - land_start)
                else:
                    results["overlap_compute_s"].append(compute_end - start)
                    results["overlap_exposed_s"].append(pushed - compute_end)
                    results["overlap_push_s"].append(pushed - start)
    finally:
        receiver.shutdown()
        sender.shutdown()
        p_engine.close()
        c_engine.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"transport": transport, "layout": layout, "pinned_arena": pinned, "bytes": nbytes, "pin_s": pin_s,
            "push_gbps": nbytes / med["burst_push_s"] / GB, "land_gbps": nbytes / med["land_s"] / GB,
            "end_to_end_gbps": nbytes / (med["burst_push_s"] + med["land_s"]) / GB,
            "overlap_compute_s": med["overlap_compute_s"], "overlap_push_s": med["overlap_push_s"],
            "overlap_exposed_s": med["overlap_exposed_s"], "burst_push_s": med["burst_push_s"], "land_s": med["land_s"]}


def check(src, dst, blocks, src_ids, dst_ids) -> None:
    """Every landed block equals the block it came from (bit for bit)."""
    device = next(iter(src.values())).device
    s_idx, d_idx = torch.tensor(src_ids, device=device), torch.tensor(dst_ids, device=device)
    for name in src:
        sent, got = blocks_first(src[name], blocks), blocks_first(dst[name], blocks)
        if not torch.equal(sent.index_select(0, s_idx), got.index_select(0, d_idx)):
            raise AssertionError(f"layer {name}: landed KV differs from what was sent")
        got.zero_()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("kv_path_cuda: no CUDA device here (this benchmark measures the GPU path; --device cpu "
                 "runs it on host caches as a smoke test)")
    transports = [t for t in args.transports.split(",") if t]
    layouts = [l for l in args.layouts.split(",") if l]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    per_token = 2 * args.kv_heads * args.head_dim * 2 * args.layers
    nbytes = args.tokens * per_token
    print(f"device: {device}; KV {per_token / 1024:.0f} KiB per token, {nbytes / GB:.2f} GB per "
          f"{args.tokens}-token prompt; chunks of {args.chunk_tokens} tokens", flush=True)
    limit = limits(nbytes, args.layers, transports, args.device)
    print("limits (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in limit.items()), flush=True)
    emulated = Emulated(args.chunk_tokens, args.layer_gflop * args.chunk_tokens / 1024, args.device)
    layer_s = timed(emulated, 5)
    print(f"emulated compute: {layer_s * 1e3:.2f} ms per layer per chunk", flush=True)
    rows = []
    pins = (True, False) if args.device == "cuda" else (False,)
    configs = [(t, "blocks_first", pin) for t in transports for pin in pins]
    configs += [(t, l, True) for t in transports for l in layouts if l != "blocks_first"]
    for transport, layout, pin in configs:
        row = run_config(args, transport, layout, pin, emulated)
        ceiling = min(limit.get("d2h_pinned", float("inf")), limit[f"{transport}_alone"])
        row["push_vs_ceiling"] = row["push_gbps"] / ceiling
        row["land_vs_h2d_pinned"] = row["land_gbps"] / limit.get("h2d_pinned", limit["host_memcpy"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"| transport | layout | arena | push GB/s (x min(D2H, transport alone)) | land GB/s (x H2D pinned) "
          f"| compute s | exposed tail s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['transport']} | {r['layout']} | {'pinned' if r['pinned_arena'] else 'pageable'} "
              f"| {r['push_gbps']:.2f} ({r['push_vs_ceiling']:.2f}x) | {r['land_gbps']:.2f} ({r['land_vs_h2d_pinned']:.2f}x) "
              f"| {r['overlap_compute_s']:.3f} | {r['overlap_exposed_s']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "limits": limit, "layer_compute_s": layer_s,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
