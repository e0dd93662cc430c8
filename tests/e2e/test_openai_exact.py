"""Disaggregated greedy output equals the same vLLM engine run colocated, token for token,
through the official openai client, streamed and not.

The disaggregated side is a conductor without conditional disaggregation in front of the spine
cluster's workers, and every compared answer's headers must name two different workers: the
serve conductor would prefill short prompts on the decode worker itself, and an exactness test
that silently compares colocated with colocated proves nothing about KV transfer.
"""


import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.e2e.prompts import CHAT_CONVERSATIONS, COMPLETION_PROMPTS

pytestmark = pytest.mark.vllm
MAX_TOKENS = 32
CHUNK_TOKENS = 2048  # the workers' prefill chunk (mooncake.defaults.CHUNK_SIZE, and the reference's)


def assert_disaggregated(headers, what: str) -> None:
    prefill, decode = headers.get("x-mooncake-prefill"), headers.get("x-mooncake-decode")
    assert prefill and decode and prefill != decode, f"{what} was not disaggregated: {prefill} / {decode}"


def completion_texts(base_url: str, stream: bool, disaggregated: bool = False) -> list[str]:
    """Greedy texts of COMPLETION_PROMPTS; `disaggregated`: also check each answer's route."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    texts = []
    for i, prompt in enumerate(COMPLETION_PROMPTS):
        raw = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0, stream=stream)
        if disaggregated:
            assert_disaggregated(raw.headers, f"completion prompt {i}")
        if stream:
            texts.append("".join(p.choices[0].text for p in raw.parse() if p.choices))
        else:
            texts.append(raw.parse().choices[0].text)
    return texts


def chat_texts(base_url: str, stream: bool, disaggregated: bool = False) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    texts = []
    for i, messages in enumerate(CHAT_CONVERSATIONS):
        raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages,
                                                               max_tokens=MAX_TOKENS, temperature=0, stream=stream)
        if disaggregated:
            assert_disaggregated(raw.headers, f"chat conversation {i}")
        if stream:
            texts.append("".join((p.choices[0].delta.content or "") for p in raw.parse() if p.choices))
        else:
            texts.append(raw.parse().choices[0].message.content)
    return texts


@pytest.fixture(scope="module")
def reference(colocated_server):
    return {"completions": completion_texts(colocated_server, False), "chat": chat_texts(colocated_server, False)}


def test_prompt_lengths_cover_short_to_longer_than_a_prefill_chunk(model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    lengths = [len(tok.encode(p)) for p in COMPLETION_PROMPTS]
    assert min(lengths) < 10 and any(1000 < n < CHUNK_TOKENS for n in lengths), lengths
    # One prompt is prefilled in more than one chunk, and still fits max_model_len (8,192).
    assert CHUNK_TOKENS < max(lengths) < 8192 - MAX_TOKENS, lengths
    assert len(set(lengths)) == len(lengths) >= 6


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completions_identical_to_colocated(reference, disaggregated_api, stream):
    assert completion_texts(disaggregated_api, stream, disaggregated=True) == reference["completions"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_identical_to_colocated(reference, disaggregated_api, stream):
    assert chat_texts(disaggregated_api, stream, disaggregated=True) == reference["chat"]


def test_decode_loaded_prompt_kv_and_computed_only_new_tokens(spine_cluster, disaggregated_api):
    """The decode worker must take the whole prompt from the connector: vLLM reports every
    prompt token as cached (not computed), and the connector counts the loaded tokens.
    Through the fixed-roles conductor: with flexible roles the decode worker may prefill the
    request itself (it does once the prefix index shows it holding prompts it decoded)."""
    decode, prefill = spine_cluster.worker_urls["decode"], spine_cluster.worker_urls["prefill"]
    before = httpx.get(decode + "/internal/kv_stats", headers=spine_cluster.internal_headers).json()["stats"]
    pushed_before = httpx.get(prefill + "/internal/kv_stats", headers=spine_cluster.internal_headers).json()["stats"]
    prompt = "A unique prompt for the recompute check: " + " ".join(f"item-{i}" for i in range(400))
    resp = httpx.post(disaggregated_api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens > 800 and body["usage"]["completion_tokens"] == 8
    assert resp.headers["x-mooncake-prefill"] != resp.headers["x-mooncake-decode"]
    # vLLM's own statistic on the decode engine: all prompt tokens came from outside (the
    # decode prompt is prompt + first token; only that first token is computed).
    assert int(resp.headers["x-mooncake-decode-cached-tokens"]) == prompt_tokens
    after = httpx.get(decode + "/internal/kv_stats", headers=spine_cluster.internal_headers).json()["stats"]
    assert after["loaded_transfers"] == before["loaded_transfers"] + 1
    assert after["loaded_tokens"] - before["loaded_tokens"] == prompt_tokens
    assert after["load_failures"] == before["load_failures"]
    pushed = httpx.get(prefill + "/internal/kv_stats", headers=spine_cluster.internal_headers).json()["stats"]
    assert pushed["pushed_transfers"] == pushed_before["pushed_transfers"] + 1
    assert pushed["push_failures"] == pushed_before["push_failures"]


def test_logit_bias_applies_on_both_sides_as_colocated(colocated_server, spine_cluster, model_path):
    """The bias must reach the prefill worker (first token) and the decode worker (the rest)."""
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(model_path).encode(" banana")[0]
    texts = []
    for base in (colocated_server, spine_cluster.api):
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
        r = client.completions.create(model=MODEL_NAME, prompt="My favourite fruit is", max_tokens=12,
                                      temperature=0, logit_bias={str(token): 6})
        texts.append(r.choices[0].text)
    assert texts[0] == texts[1]
    assert texts[1].startswith(" banana"), texts


@pytest.mark.parametrize("options", [{"frequency_penalty": 1.5}, {"presence_penalty": 1.2},
                                     {"temperature": 1.0, "seed": 1234}],
                         ids=["frequency_penalty", "presence_penalty", "seed"])
def test_sampling_that_depends_on_every_generated_token_matches_colocated(colocated_server, disaggregated_api,
                                                                          options):
    """Output-token penalties and a seeded generator must see the first token as generated: the
    decode worker samples it itself (the prefill worker's is dropped), as one engine would."""
    texts = []
    for base in (colocated_server, disaggregated_api):
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="one one one one one one, two two two, and then", max_tokens=24,
            **{"temperature": 0, **options})
        if base == disaggregated_api:
            assert_disaggregated(raw.headers, str(options))
        texts.append(raw.parse().choices[0].text)
    assert texts[0] == texts[1]
