"""The KVCache pool's copies on a GPU: a prompt's blocks saved from the paged cache into the node's
DRAM pool, and loaded back, layer by layer, into another engine's cache, at a real model's KV
geometry, beside the bus's limits measured in the same run.

    python -m benchmarks.pool_cuda                   # Llama-3.1-8B's KV, 8k-token prompts

The pool service (store/service.py) runs in this process with its arena in shared memory, as on a
node; the pool connector's worker half (kv_connector/pool_copier.py) copies through pinned host
memory. No vLLM runs (see benchmarks/kv_path_cuda.py): the planner is driven by hand. Every
loaded block is compared bit for bit with the block saved.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from benchmarks.kv_path_cuda import GB, geometry_parser, limits, make_caches, sync
from kv_connector.pool_copier import PoolCopier
from kv_connector.pool_planner import PoolPlanner
from mooncake.kv_layout import block_bytes, blocks_first
from store.channel import PoolClient
from store.config import PoolConfig
from store.service import PoolService


def parse_args(argv=None) -> argparse.Namespace:
    p = geometry_parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="requests (after one warm-up)")
    p.add_argument("--layout", default="blocks_first", help="blocks_first or kv_first")
    return p.parse_args(argv)


class _Manager:
    def __init__(self):
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],)


def _step(req: str, computed: int, scheduled: int):
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req, num_computed_tokens=computed)],
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                           num_scheduled_tokens={req: scheduled}, preempted_req_ids=set())


def _request(req: str, tokens: list[int]):
    return SimpleNamespace(request_id=req, all_token_ids=tokens, kv_transfer_params=None, num_tokens=len(tokens),
                           num_output_tokens=0)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def run(args) -> dict:
    n = args.tokens // args.block_size
    blocks = n + 8
    src, dst = make_caches(args, args.layout, blocks, True), make_caches(args, args.layout, blocks, False)
    nbytes = n * args.layers * block_bytes(blocks_first(next(iter(src.values())), blocks))
    # Room for one prompt: each save evicts the one before, so after the warm-up the arena's pages
    # are ones a long-running node has touched before (the first write to a tmpfs page faults it in).
    service = PoolService(PoolConfig(dram_bytes=nbytes + (64 << 20), ssd_dir=None), remote=False).start()
    writer = PoolCopier(lambda t: PoolClient(service.endpoint, t), args.block_size, load_timeout_s=120.0)
    reader = PoolCopier(lambda t: PoolClient(service.endpoint, t), args.block_size, load_timeout_s=120.0)
    save_s, load_s = [], []
    try:
        writer.register_kv_caches(src, blocks)
        reader.register_kv_caches(dst, blocks)
        if writer._arena is None:
            raise RuntimeError("the pool's arena could not be mapped (shared memory too small?)")
        for r in range(args.repeats + 1):
            rng = random.Random(r)
            tokens = [rng.randrange(1, 50000) for _ in range(args.tokens)] + [7]  # n full blocks and one token
            src_ids = list(range(n + 1))
            saver, manager = PoolPlanner(PoolClient(service.endpoint), args.block_size), _Manager()
            saver.bind_kv_cache_manager(manager)
            manager.blocks[f"s{r}"] = src_ids
            saver.after_alloc(_request(f"s{r}", tokens), _blocks(src_ids), 0)
            _, saves, _ = saver.plan(_step(f"s{r}", 0, len(tokens)))
            start = time.perf_counter()
            for name in src:
                writer.save_layer(saves, name)
            writer.flush([f"s{r}"])  # both save stages done, the keys committed
            saved = time.perf_counter() - start
            dst_ids = list(reversed(range(blocks - n - 1, blocks)))
            loader, manager = PoolPlanner(PoolClient(service.endpoint), args.block_size), _Manager()
            loader.bind_kv_cache_manager(manager)
            manager.blocks[f"l{r}"] = dst_ids
            request = _request(f"l{r}", tokens)
            matched, later = loader.matched_tokens(request, 0)
            if matched != n * args.block_size or later:
                raise RuntimeError(f"the pool matched {matched} tokens (async: {later}), {n * args.block_size} expected")
            loader.after_alloc(request, _blocks(dst_ids), matched)
            loads, _, _ = loader.plan(_step(f"l{r}", matched, 1))
            start = time.perf_counter()
            reader.start_loads(loads)
            for name in dst:
                reader.wait_for_layer(name)
            sync()
            loaded = time.perf_counter() - start
            if reader.take_invalid_blocks():
                raise RuntimeError("some blocks could not be loaded")
            device = next(iter(src.values())).device
            s_idx, d_idx = torch.tensor(src_ids[:n], device=device), torch.tensor(dst_ids[:n], device=device)
            for name in src:
                sent, got = blocks_first(src[name], blocks), blocks_first(dst[name], blocks)
                if not torch.equal(sent.index_select(0, s_idx), got.index_select(0, d_idx)):
                    raise AssertionError(f"layer {name}: loaded KV differs from what was saved")
                got.zero_()
            if r:
                save_s.append(saved)
                load_s.append(loaded)
            else:
                first = {"first_save_s": saved, "first_load_s": loaded}
    finally:
        writer.shutdown()
        reader.shutdown()
        service.close()
    save, load = statistics.median(save_s), statistics.median(load_s)
    return {"bytes": nbytes, "save_s": save, "load_s": load, "save_gbps": nbytes / save / GB,
            "load_gbps": nbytes / load / GB, **first}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("pool_cuda: no CUDA device here (--device cpu runs it on host caches as a smoke test)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    per_token = 2 * args.kv_heads * args.head_dim * 2 * args.layers
    print(f"device: {device}; {args.tokens}-token prompts, {args.tokens * per_token / GB:.2f} GB of KV", flush=True)
    limit = limits(args.tokens * per_token, args.layers, [], args.device)
    print("limits (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in limit.items()), flush=True)
    row = run(args)
    row["save_vs_d2h_pinned"] = row["save_gbps"] / limit.get("d2h_pinned", limit["host_memcpy"])
    row["load_vs_h2d_pinned"] = row["load_gbps"] / limit.get("h2d_pinned", limit["host_memcpy"])
    print(json.dumps(row), flush=True)
    print(f"save {row['save_gbps']:.2f} GB/s ({row['save_vs_d2h_pinned']:.2f}x D2H pinned), "
          f"load {row['load_gbps']:.2f} GB/s ({row['load_vs_h2d_pinned']:.2f}x H2D pinned; "
          f"{row['load_s'] * 1e3:.0f} ms for the prompt's KV); the warm-up, into fresh arena pages: save "
          f"{row['first_save_s'] * 1e3:.0f} ms, load {row['first_load_s'] * 1e3:.0f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "limits": limit, "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
