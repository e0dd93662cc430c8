"""The KV path on the real cluster: every chunk of a long prompt streams, 32 concurrent requests'
layers interleave without mixing, blocks the decode worker holds are not sent (nor any for a
one-token answer), and a byte flipped on the wire (tcp forced) is caught and recomputed, never
wrong text.

Greedy output is compared with stock vLLM run colocated (`colocated_server`), token for token.
The shared spine cluster is used through `disaggregated_api` (fixed roles: every request is
prefilled on P and decoded on D). The fault test starts its own small cluster, because its
workers need settings no other test may see (MOONCAKE_KV_TRANSPORTS=tcp, MOONCAKE_KV_FAULT_FLIP).
"""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx
import openai
import pytest

from mooncake import defaults
from tests.conftest import MODEL_NAME
from tests.e2e.prompts import COMPLETION_PROMPTS
from tests.prefix_index import wait_cached
from tests.processes import KV_CACHE_GIB, free_port, free_port_block, start, wait_http

pytestmark = pytest.mark.vllm
BLOCK = defaults.KV_BLOCK_SIZE


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK)


def kv_stats(url: str, headers: dict) -> dict:
    return httpx.get(url + "/internal/kv_stats", headers=headers, timeout=10).json()


def complete(base: str, prompt, max_tokens: int = 8) -> httpx.Response:
    resp = httpx.post(base + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp


def tokenize(model_path: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).encode(text)


def test_a_prompt_longer_than_a_chunk_streams_in_every_chunk(spine_cluster, disaggregated_api, colocated_server):
    # Over one prefill chunk (tests/e2e/test_openai_exact.py checks its length); the nonce keeps it
    # out of P's prefix cache, so every chunk is computed here.
    prompt = f"Nonce {secrets.token_hex(8)}. " + COMPLETION_PROMPTS[-1]
    resp = complete(disaggregated_api, prompt)
    assert resp.json()["choices"][0]["text"] == complete(colocated_server, prompt).json()["choices"][0]["text"]
    tokens = resp.json()["usage"]["prompt_tokens"]
    assert tokens > defaults.CHUNK_SIZE
    prefill = kv_stats(spine_cluster.worker_urls["prefill"], spine_cluster.internal_headers)
    entry = next(t for t in reversed(prefill["layer_timeline"]) if t["num_tokens"] == tokens)
    assert entry["chunks"] >= 2  # the first chunk's blocks went before the last chunk was computed
    layers = entry["layers"]
    assert len(layers) > 1 and all(0 < computed <= landed for computed, landed in layers)
    # Layer by layer: the first layer was computed before the last one.
    assert layers[0][0] <= layers[-1][0]
    # Same host: where the shm transport runs, the engine chose it over tcp for the KV.
    moved = kv_stats(spine_cluster.worker_urls["decode"], spine_cluster.internal_headers)["messenger"]
    expected = "shm" if "shm" in moved else "tcp"
    assert moved[expected]["received_bytes"] > 0, moved


def test_32_concurrent_requests_interleave_without_mixing(spine_cluster, disaggregated_api, colocated_server):
    prompts = [f"Request {i}: " + " ".join(f"{(i * 7 + k) % 97}-{k}" for k in range(20 + 2 * i)) for i in range(32)]
    reference = [complete(colocated_server, p, 6).json()["choices"][0]["text"] for p in prompts]
    decode = spine_cluster.worker_urls["decode"]
    before = kv_stats(decode, spine_cluster.internal_headers)["stats"]
    samples_before = prefill_samples(disaggregated_api, spine_cluster.internal_headers)

    async def run():
        client = openai.AsyncOpenAI(base_url=disaggregated_api, api_key="unused", max_retries=0, timeout=600)
        answers = await asyncio.gather(*(client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
            # 32 prefills at once: the batch class's 240 s limit admits them all. (The queue model
            # prices them one after another, each with its own per-request cost; vLLM batches short
            # prompts, so the real wait is shorter than predicted: with the 30 s default class the
            # batch limit was 24 s, and the last prompts were refused in CI at 24.7 s.)
            extra_headers={"X-Mooncake-SLO-Class": "batch"}) for p in prompts))
        await client.close()
        return answers

    answers = asyncio.run(run())
    assert [a.parse().choices[0].text for a in answers] == reference
    for a in answers:  # every prompt token came from its own pushed KV
        assert int(a.headers["x-mooncake-decode-cached-tokens"]) == a.parse().usage.prompt_tokens
    after = kv_stats(decode, spine_cluster.internal_headers)["stats"]
    assert after["loaded_transfers"] - before["loaded_transfers"] == 32
    assert after["load_failures"] == before["load_failures"]
    # Prompts computed together measure the burst, not P's speed: they do not calibrate it.
    assert prefill_samples(disaggregated_api, spine_cluster.internal_headers) - samples_before < 32


def prefill_samples(api: str, headers: dict) -> int:
    """Prefill calibration samples the conductor behind `api` has taken, over all instances."""
    body = httpx.get(api.removesuffix("/v1") + "/internal/debug/estimators", headers=headers, timeout=10).json()
    return sum(fits["prefill"]["samples"] for fits in body["instances"].values())


def test_blocks_the_decode_worker_holds_are_not_sent(spine_cluster, disaggregated_api, colocated_server, model_path):
    head = tokenize(model_path, f"Nonce {secrets.token_hex(8)}. " + COMPLETION_PROMPTS[3])
    tail = tokenize(model_path, " And then, " + COMPLETION_PROMPTS[2])
    prefill, decode = spine_cluster.worker_urls["prefill"], spine_cluster.worker_urls["decode"]
    headers = spine_cluster.internal_headers

    p0, d0 = kv_stats(prefill, headers)["stats"], kv_stats(decode, headers)["stats"]
    complete(disaggregated_api, head, 2)  # D loads it, and keeps it in its prefix cache
    p1, d1 = kv_stats(prefill, headers)["stats"], kv_stats(decode, headers)["stats"]
    layers = (p1["pushed_blocks"] - p0["pushed_blocks"]) // blocks(len(head))
    assert layers > 1 and p1["pushed_blocks"] - p0["pushed_blocks"] == blocks(len(head)) * layers
    assert d1["received_blocks"] - d0["received_blocks"] == blocks(len(head)) * layers
    held = len(head) // BLOCK  # D's full blocks of `head`: the rest of the prompt is new to it
    # The conductor's prefix index learns D's new blocks from its KV events.
    wait_cached(disaggregated_api.removesuffix("/v1"), headers, head, decode, held)

    prompt = head + tail
    resp = complete(disaggregated_api, prompt, 8)
    assert resp.json()["choices"][0]["text"] == complete(colocated_server, prompt, 8).json()["choices"][0]["text"]
    p2, d2 = kv_stats(prefill, headers)["stats"], kv_stats(decode, headers)["stats"]
    assert p2["pushed_blocks"] - p1["pushed_blocks"] == (blocks(len(prompt)) - held) * layers
    assert d2["received_blocks"] - d1["received_blocks"] == (blocks(len(prompt)) - held) * layers
    assert int(resp.headers["x-mooncake-decode-cached-tokens"]) == len(prompt)  # held + received
    assert d2["load_failures"] == d1["load_failures"]


def test_a_one_token_answer_sends_no_kv(spine_cluster, disaggregated_api, colocated_server):
    """The prefill worker's token is the whole answer: its KV would go to the decode worker only to
    be dropped there."""
    prompt = f"Nonce {secrets.token_hex(8)}. " + COMPLETION_PROMPTS[1]
    prefill, decode = spine_cluster.worker_urls["prefill"], spine_cluster.worker_urls["decode"]
    headers = spine_cluster.internal_headers
    p0, d0 = kv_stats(prefill, headers)["stats"], kv_stats(decode, headers)["stats"]
    resp = complete(disaggregated_api, prompt, 1)
    assert resp.json()["choices"][0]["text"] == complete(colocated_server, prompt, 1).json()["choices"][0]["text"]
    assert resp.json()["usage"]["completion_tokens"] == 1
    p1, d1 = kv_stats(prefill, headers)["stats"], kv_stats(decode, headers)["stats"]
    assert p1["pushed_blocks"] == p0["pushed_blocks"] and d1["received_blocks"] == d0["received_blocks"]
    complete(disaggregated_api, prompt + " Then", 2)  # a longer answer still goes through D with its KV
    assert kv_stats(prefill, headers)["stats"]["pushed_blocks"] > p1["pushed_blocks"]


@pytest.fixture(scope="module")
def tcp_faulty_cluster(model_path, log_dir):
    """`mooncake serve` (1 prefill + 1 decode) whose KV engines run tcp only, and whose first
    written batch gets one byte flipped on the wire; plus a fixed-roles conductor in front."""
    port, worker_port = free_port(), free_port_block(2)
    token_file = log_dir / "kv-fault-token"
    token_file.write_text(secrets.token_urlsafe(32))
    env = {"MOONCAKE_KV_TRANSPORTS": "tcp", "MOONCAKE_KV_FAULT_FLIP": "1"}
    serve = start("serve-kv-fault", ["-m", "mooncake.cli", "serve", "--port", str(port), "--worker-port",
                                     str(worker_port), "--kv-cache-gib", KV_CACHE_GIB, "--cluster-token-file", str(token_file)],
                  log_dir, env=env)
    workers = {"prefill": f"http://127.0.0.1:{worker_port}", "decode": f"http://127.0.0.1:{worker_port + 1}"}
    conductor_port = free_port()
    conductor = None
    try:
        wait_http(serve, f"http://127.0.0.1:{port}/health", 300)
        conductor = start("conductor-kv-fault", [
            "-m", "mooncake.cli", "conductor", "--port", str(conductor_port), "--model", model_path,
            "--served-model-name", MODEL_NAME, "--no-conditional-disaggregation", "--no-flexible-roles",
            "--cluster-token-file", str(token_file), "--prefill-url", workers["prefill"],
            "--decode-url", workers["decode"]], log_dir)
        base = f"http://127.0.0.1:{conductor_port}"
        wait_http(conductor, base + "/health", 120)
        deadline = time.monotonic() + 120
        while min(httpx.get(base + "/health").json()["ready"].values()) < 1:
            assert time.monotonic() < deadline, "the conductor never saw both workers ready"
            time.sleep(0.5)
        yield base + "/v1", workers, {"X-Mooncake-Cluster-Token": token_file.read_text().strip()}, conductor
    finally:
        if conductor is not None:
            conductor.stop()
        serve.stop(grace_s=30)


def test_tcp_greedy_identical_and_a_flipped_byte_is_caught(tcp_faulty_cluster, colocated_server):
    api, workers, headers, conductor = tcp_faulty_cluster
    prompt = COMPLETION_PROMPTS[-1]  # longer than one chunk
    reference = complete(colocated_server, prompt).json()["choices"][0]["text"]

    # The first push's first batch is corrupted on the wire: caught, and the prompt recomputed on D.
    first = complete(api, prompt)
    assert first.json()["choices"][0]["text"] == reference
    tokens = first.json()["usage"]["prompt_tokens"]
    prefill, decode = kv_stats(workers["prefill"], headers), kv_stats(workers["decode"], headers)
    assert decode["stats"]["checksum_failures"] == 1 and prefill["stats"]["push_failures"] == 1
    assert decode["stats"]["loaded_transfers"] == 0
    assert int(first.headers["x-mooncake-decode-cached-tokens"]) < tokens  # D computed it

    # The next one is clean, over tcp (no other transport runs in these workers).
    second = complete(api, prompt)
    assert second.json()["choices"][0]["text"] == reference
    decode = kv_stats(workers["decode"], headers)
    route = {k: v for k, v in second.headers.items() if k.startswith("x-mooncake-")}
    why = f"route {route}, decode stats {decode['stats']}, conductor log:\n{conductor.log_tail(30)}"
    assert route["x-mooncake-prefill"] != route["x-mooncake-decode"], why  # pushed, not colocated
    assert decode["stats"]["loaded_transfers"] == 1 and decode["stats"]["load_failures"] == 0, why
    transports = [t for t in decode["messenger"] if t != "lane"]  # "lane": its calls (messenger/call_lane.py)
    assert transports == ["tcp"] and decode["messenger"]["tcp"]["received_bytes"] > 0
