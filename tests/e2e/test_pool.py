"""The KVCache pool through the real path: a worker (`mooncake prefill`: its shell, the pool
service, vLLM with both connectors) answering /internal/generate, its engine's own prefix cache
dropped between requests (/internal/reset_prefix_cache) so that only the pool can supply a prefix.

Every answer is compared with stock vLLM (the shared `colocated_server`, no connector) computing
the same prompt cold, token for token (greedy, float32); vLLM's num_cached_tokens says how much of
the prompt was not computed. The pool is small (0.0625 GiB of DRAM: 10 blocks of 128 tokens),
so a few long prompts push older blocks to the SSD tier.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import uuid
from pathlib import Path

import httpx
import pytest

from mooncake.hashing import hash_prompt_blocks
from store.ssd import SUFFIX
from tests.conftest import MODEL_NAME
from tests.processes import KV_CACHE_GIB, free_port, start, wait_http

pytestmark = pytest.mark.vllm

BLOCK = 128
DRAM_GIB = 0.0625


class PoolWorker:
    """One worker process with a pool; restart() keeps its SSD directory."""

    def __init__(self, log_dir: Path, ssd_dir: Path):
        self.log_dir, self.ssd_dir = log_dir, ssd_dir
        self.loaded_tokens: int | None = None  # what the last generate's worker loaded from a pool
        self.token_file = log_dir / "pool-token"
        if not self.token_file.exists():
            self.token_file.write_text(secrets.token_urlsafe(32))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"X-Mooncake-Cluster-Token": self.token_file.read_text()}
        self.starts = 0
        self.proc = None
        self.name = f"pool-worker-{self.port}"

    def start(self) -> None:
        self.starts += 1
        self.proc = start(f"{self.name}-{self.starts}", [
            "-m", "mooncake.cli", "prefill", "--port", str(self.port), "--kv-cache-gib", KV_CACHE_GIB,
            "--pool-dram-gib", str(DRAM_GIB), "--pool-ssd-dir", str(self.ssd_dir), "--pool-ssd-gib", "1",
            "--instance-id", self.name, "--cluster-token-file", str(self.token_file)], self.log_dir)
        wait_http(self.proc, self.url + "/health", 300)

    def stop(self) -> None:
        self.proc.stop(grace_s=30)

    def generate(self, prompt: list[int], max_tokens: int = 12,
                 kv_transfer_params: dict | None = None) -> tuple[list[int], int]:
        body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": prompt, "kv_transfer_params": kv_transfer_params or {},
                "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        tokens, cached, self.loaded_tokens = [], None, None
        with httpx.stream("POST", self.url + "/internal/generate", json=body, headers=self.headers,
                          timeout=300) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                chunk = json.loads(line)
                assert not chunk.get("error"), chunk
                tokens += chunk["token_ids"]
                if chunk.get("num_cached_tokens") is not None and cached is None:
                    cached = chunk["num_cached_tokens"]
                if chunk.get("finish_reason"):  # what the pool loaded: the conductor's calibration skips these
                    self.loaded_tokens = chunk.get("prefill_loaded_tokens", 0)
        return tokens, cached

    def forget(self) -> None:
        """Drop the engine's own prefix cache: from now on only the pool holds those blocks."""
        for _ in range(50):
            if httpx.post(self.url + "/internal/reset_prefix_cache", headers=self.headers).json()["ok"]:
                return
            time.sleep(0.2)  # vLLM refuses while a request still holds blocks
        raise AssertionError("vLLM never reset its prefix cache")

    def events(self) -> dict:
        """A snapshot of its KV events page, as a conductor's first poll gets it."""
        return httpx.get(self.url + "/internal/kv_events", params={"since": -1}, headers=self.headers).json()

    def metric(self, name: str, **labels) -> float:
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def pool_worker(model_path, log_dir, tmp_path_factory):
    worker = PoolWorker(log_dir, tmp_path_factory.mktemp("pool-ssd"))
    worker.start()
    yield worker
    worker.stop()


def cold(colocated_server: str, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """Stock vLLM's greedy answer (no connector, no pool)."""
    resp = httpx.post(colocated_server + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def prompt_of(seed: int, n: int) -> list[int]:
    """A deterministic prompt of n ordinary tokens, unique per seed (never shared by two tests)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def wait_for(check, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def ssd_file(pool_worker: PoolWorker, key: int) -> Path | None:
    """The SSD tier's file of one block, once written (store/ssd.py: under a folder per KV
    layout, named by the key; a file still being written ends in .tmp)."""
    return next(Path(pool_worker.ssd_dir).rglob(format(key, "032x") + SUFFIX), None)


def wait_spilled(pool_worker: PoolWorker, keys: list[int]) -> None:
    """Every block in `keys` written to the SSD tier (a spill is planned at once, written after)."""
    wait_for(lambda: all(ssd_file(pool_worker, k) is not None for k in keys), what="spills to SSD")


def test_prefix_from_dram_computes_only_the_suffix(pool_worker, colocated_server):
    prefix = prompt_of(1, 6 * BLOCK)
    first, second = prefix + prompt_of(11, 40), prefix + prompt_of(12, 70)
    out, cached = pool_worker.generate(first)
    assert out == cold(colocated_server, first)
    assert pool_worker.loaded_tokens == 0
    pool_worker.forget()
    # The conductor's view (its prefix index, priced by tier): the prefix is still held, only in
    # DRAM. vLLM publishes the reset with its next step's events, so one short request runs first.
    pool_worker.generate(prompt_of(13, 5), max_tokens=1)
    keys = [format(k, "x") for k in hash_prompt_blocks(prefix, BLOCK)]
    wait_for(lambda: all(pool_worker.events()["pool_tiers"].get(k) == "dram" for k in keys), what="pool tiers")
    out, cached = pool_worker.generate(second)
    assert cached == 6 * BLOCK  # the shared prefix came from the pool, the rest was computed
    assert pool_worker.loaded_tokens == 6 * BLOCK  # and the worker says so on its last line
    # Loaded back into the engine's cache: free to reuse again.
    wait_for(lambda: not any(k in pool_worker.events()["pool_tiers"] for k in keys), what="blocks back in the engine")
    assert out == cold(colocated_server, second)


def test_prefix_evicted_to_ssd_is_promoted_and_reused(pool_worker, colocated_server):
    prefix = prompt_of(2, 5 * BLOCK)
    first = prefix + prompt_of(21, 30)
    pool_worker.generate(first)
    # Longer prompts than the DRAM tier holds push the prefix's blocks out to SSD.
    for seed in (22, 23):
        pool_worker.generate(prompt_of(seed, 9 * BLOCK + 5), max_tokens=2)
    keys = hash_prompt_blocks(prefix, BLOCK)
    wait_spilled(pool_worker, keys)
    promotions = pool_worker.metric("mooncake_store_events_total", kind="promotions")
    pool_worker.forget()
    second = prefix + prompt_of(24, 50)
    out, cached = pool_worker.generate(second)
    assert cached == 5 * BLOCK
    assert pool_worker.metric("mooncake_store_events_total", kind="promotions") >= promotions + 5
    assert out == cold(colocated_server, second)


def test_five_turn_conversation_computes_only_each_turns_new_tokens(pool_worker, colocated_server):
    history = prompt_of(3, 200)
    expected = 0
    for turn in range(5):
        pool_worker.forget()  # each turn must find the previous ones (answers included) in the pool
        out, cached = pool_worker.generate(history, max_tokens=40)
        assert out == cold(colocated_server, history, max_tokens=40), f"turn {turn}"
        assert cached == expected, (turn, cached, expected)
        # The KV of everything but the answer's last token (sampled, never fed back) now exists:
        # its whole blocks are the next turn's cached prefix.
        expected = (len(history) + len(out) - 1) // BLOCK * BLOCK
        history = history + out + prompt_of(30 + turn, 90)


def test_prefix_survives_a_worker_restart(pool_worker, colocated_server):
    prefix = prompt_of(4, 4 * BLOCK)
    pool_worker.generate(prefix + prompt_of(41, 20))
    keys = hash_prompt_blocks(prefix, BLOCK)
    # Spilled to SSD by later prompts; then the worker restarts: DRAM is gone, SSD is not.
    for seed in (42, 43):
        pool_worker.generate(prompt_of(seed, 9 * BLOCK + 5), max_tokens=2)
    wait_spilled(pool_worker, keys)
    pool_worker.stop()
    pool_worker.start()
    second = prefix + prompt_of(44, 60)
    out, cached = pool_worker.generate(second)
    assert cached == 4 * BLOCK
    assert out == cold(colocated_server, second)


def test_block_corrupted_on_disk_is_recomputed(pool_worker, colocated_server):
    prefix = prompt_of(5, 4 * BLOCK)
    pool_worker.generate(prefix + prompt_of(51, 20))
    for seed in (52, 53):
        pool_worker.generate(prompt_of(seed, 9 * BLOCK + 5), max_tokens=2)
    keys = hash_prompt_blocks(prefix, BLOCK)
    wait_spilled(pool_worker, keys)
    # Flip bytes in the middle of the prefix's second block on disk.
    victim = ssd_file(pool_worker, keys[1])
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\xff" * 64)
    corrupt = pool_worker.metric("mooncake_store_events_total", kind="corrupt")
    pool_worker.forget()
    second = prefix + prompt_of(54, 30)
    out, _ = pool_worker.generate(second)
    assert out == cold(colocated_server, second)
    assert pool_worker.metric("mooncake_store_events_total", kind="corrupt") == corrupt + 1


def test_prefix_on_another_instance_is_fetched_from_its_pool_and_kept(pool_worker, colocated_server, log_dir,
                                                                     tmp_path):
    """Algorithm 1's fetch_from, carried out: the prefill worker is told (kv_transfer_params, as
    the conductor's relay does) to take the prefix from another worker's pool."""
    prefix = prompt_of(6, 5 * BLOCK)
    pool_worker.generate(prefix + prompt_of(61, 20))  # computed on the first worker, saved in its pool
    holder = httpx.get(pool_worker.url + "/health").json()
    assert holder.get("pool_peer"), holder
    other = PoolWorker(log_dir, tmp_path / "ssd")
    other.token_file, other.headers = pool_worker.token_file, pool_worker.headers
    other.start()
    try:
        second = prefix + prompt_of(62, 40)
        fetch = {"mooncake_fetch": {"peer": holder["pool_peer"], "num_tokens": len(prefix)}}
        out, cached = other.generate(second, kv_transfer_params=fetch)
        assert cached == 5 * BLOCK == other.loaded_tokens  # fetched, not computed
        assert out == cold(colocated_server, second)
        assert other.metric("mooncake_store_events_total", kind="remote_fetched_blocks") >= 5
        # Kept after: the same prefix hits the second worker's own pool now.
        other.forget()
        third = prefix + prompt_of(63, 10)
        out, cached = other.generate(third)
        assert cached == 5 * BLOCK
        assert out == cold(colocated_server, third)
    finally:
        other.stop()
