"""Algorithm 1's fetch_from on the real cluster, routed by the conductor: the decode worker saved
a conversation's answer in its KVCache pool, and the next turn's prefill worker takes those
blocks from that pool (through the messenger) instead of computing them.

The shared spine cluster is used through `disaggregated_api` (fixed roles: every request is
prefilled on P and decoded on D), whose conductor runs with its defaults otherwise: remote
fetches on. Greedy output is compared with stock vLLM (`colocated_server`), token for token.
"""

from __future__ import annotations

import random
import secrets

import httpx
import pytest

from mooncake import defaults
from tests.conftest import MODEL_NAME
from tests.e2e.test_metrics_counts import Scrape
from tests.prefix_index import wait_cached

pytestmark = pytest.mark.vllm
BLOCK = defaults.KV_BLOCK_SIZE


def metric(url: str, name: str, **labels: str) -> float:
    return Scrape(url).sum(name, **labels)


def tokens(n: int) -> list[int]:
    """n ordinary token ids no other test sends."""
    rng = random.Random(secrets.randbits(64))
    return [rng.randrange(1000, 40000) for _ in range(n)]


def complete(api: str, prompt: list[int], max_tokens: int, token_ids: bool = False) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if token_ids:  # stock vLLM only: the answer's ids, to build the next turn from
        body["return_token_ids"] = True
    resp = httpx.post(api + "/completions", timeout=300, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_next_turn_fetches_the_answer_the_decode_worker_saved(spine_cluster, disaggregated_api,
                                                                  colocated_server):
    conductor = disaggregated_api.removesuffix("/v1")
    prefill = spine_cluster.worker_urls["prefill"]
    # Turn one: under one block of prompt, so P keeps no block of it; D decodes 160 tokens and
    # saves the whole blocks of prompt + answer (the last sampled token has no KV yet): 2 blocks.
    question = tokens(100)
    answer = complete(colocated_server, question, 160, token_ids=True)["choices"][0]
    ours = complete(disaggregated_api, question, 160)["choices"][0]
    assert ours["text"] == answer["text"]
    held = (len(question) + len(answer["token_ids"]) - 1) // BLOCK
    assert held == 2

    # The conductor learns D's blocks from its KV events (long poll: at once, but asynchronously).
    # Asked by these blocks, not by the index's size: other blocks may leave it meanwhile.
    wait_cached(conductor, spine_cluster.internal_headers, question + answer["token_ids"][:-1],
                spine_cluster.worker_urls["decode"], held)
    fetches = metric(conductor, "mooncake_prefix_fetches_total")
    fetched_tokens = metric(conductor, "mooncake_prefix_fetch_tokens_total")
    fetched_blocks = metric(prefill, "mooncake_store_events_total", kind="remote_fetched_blocks")

    # Turn two: P holds none of it and D holds 2 blocks, so P fetches them from D's pool.
    turn_two = question + answer["token_ids"] + tokens(30)
    body = complete(disaggregated_api, turn_two, 8)
    assert body["choices"][0]["text"] == complete(colocated_server, turn_two, 8)["choices"][0]["text"]
    assert metric(conductor, "mooncake_prefix_fetches_total") == fetches + 1
    assert metric(conductor, "mooncake_prefix_fetch_tokens_total") == fetched_tokens + held * BLOCK
    assert metric(prefill, "mooncake_store_events_total", kind="remote_fetched_blocks") == fetched_blocks + held
    # P computed only the rest: the fetched blocks count as cached prompt tokens.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == held * BLOCK
