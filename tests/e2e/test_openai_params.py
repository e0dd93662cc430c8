"""The OpenAI parameters beyond plain sampling, through the official openai client, streamed and
not, on the disaggregated path (a conductor that always prefills on the prefill worker and decodes
on the decode worker), checked against stock vLLM run colocated on the same engine settings:
greedy tokens identical, logprobs within 1e-3, the same top-logprob token sets.

Each answer compared must have been disaggregated (its headers name two workers): comparing
colocated with colocated would prove nothing about logprobs that come from two engines.
"""

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.e2e.test_openai_exact import assert_disaggregated

pytestmark = pytest.mark.vllm
TOLERANCE = 1e-3  # absolute, on logprobs (float32 engines)
BLOCK = 128  # the workers' KV block (mooncake.defaults.KV_BLOCK_SIZE): prefix caching's unit
PROMPT = "The three most useful things to pack for a long hike are"
CHAT = [{"role": "user", "content": "Name two planets of the solar system."}]
LONG_PROMPT = "Notes from the archive, entry by entry: " + " ".join(
    f"entry {i} lists {i * 7 % 13} maps;" for i in range(60))


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)


def completion(base: str, stream: bool, **kwargs) -> tuple[dict, dict]:
    """(the answer as one body, the response headers), a stream joined per choice like a body."""
    raw = client(base).completions.with_raw_response.create(model=MODEL_NAME, stream=stream, **kwargs)
    if not stream:
        return raw.parse().model_dump(), raw.headers
    choices: dict[int, dict] = {}
    usage = None
    for part in raw.parse():
        usage = part.usage.model_dump() if part.usage else usage
        for c in part.choices:
            into = choices.setdefault(c.index, {"index": c.index, "text": "", "finish_reason": None, "logprobs": None,
                                                "stop_reason": None})
            into["text"] += c.text
            into["finish_reason"] = c.finish_reason or into["finish_reason"]
            into["stop_reason"] = (c.model_extra or {}).get("stop_reason", into["stop_reason"]) \
                if c.finish_reason else into["stop_reason"]
            if c.logprobs is not None:
                lp = into["logprobs"] = into["logprobs"] or {k: [] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                             "text_offset")}
                for key in lp:
                    lp[key] += getattr(c.logprobs, key)
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}, raw.headers


def chat(base: str, stream: bool, **kwargs) -> tuple[dict, dict]:
    raw = client(base).chat.completions.with_raw_response.create(model=MODEL_NAME, stream=stream, **kwargs)
    if not stream:
        body = raw.parse().model_dump()
        for c in body["choices"]:
            c["text"] = c["message"]["content"]
        return body, raw.headers
    choices: dict[int, dict] = {}
    usage = None
    for part in raw.parse():
        usage = part.usage.model_dump() if part.usage else usage
        for c in part.choices:
            into = choices.setdefault(c.index, {"index": c.index, "text": "", "finish_reason": None, "logprobs": None,
                                                "stop_reason": None})
            into["text"] += c.delta.content or ""
            into["finish_reason"] = c.finish_reason or into["finish_reason"]
            into["stop_reason"] = (c.model_extra or {}).get("stop_reason", into["stop_reason"]) \
                if c.finish_reason else into["stop_reason"]
            if c.logprobs is not None:
                into["logprobs"] = into["logprobs"] or {"content": []}
                into["logprobs"]["content"] += [t.model_dump() for t in c.logprobs.content or ()]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}, raw.headers


def assert_same_completion_logprobs(ours: dict, ref: dict) -> None:
    assert ours["tokens"] == ref["tokens"]
    assert ours["text_offset"] == ref["text_offset"]
    for a, b in zip(ours["token_logprobs"], ref["token_logprobs"], strict=True):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= TOLERANCE), (a, b)
    for a, b in zip(ours["top_logprobs"], ref["top_logprobs"], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert set(a) == set(b)
            assert all(abs(a[t] - b[t]) <= TOLERANCE for t in a), (a, b)


def assert_same_chat_logprobs(ours: dict, ref: dict) -> None:
    assert [t["token"] for t in ours["content"]] == [t["token"] for t in ref["content"]]
    for a, b in zip(ours["content"], ref["content"], strict=True):
        assert abs(a["logprob"] - b["logprob"]) <= TOLERANCE and a["bytes"] == b["bytes"]
        assert {t["token"] for t in a["top_logprobs"]} == {t["token"] for t in b["top_logprobs"]}
        assert len(a["top_logprobs"]) == len(b["top_logprobs"])
        tops = {t["token"]: t["logprob"] for t in b["top_logprobs"]}
        assert all(abs(t["logprob"] - tops[t["token"]]) <= TOLERANCE for t in a["top_logprobs"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_completion_logprobs_match_colocated(colocated_server, disaggregated_api, stream):
    for prompt in (PROMPT, LONG_PROMPT):
        args = dict(prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
        ref, _ = completion(colocated_server, False, **args)
        ours, headers = completion(disaggregated_api, stream, **args, stream_options={"include_usage": True}
                                   if stream else None)
        assert_disaggregated(headers, "completion with logprobs")
        assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
        # The first token's logprobs come from the prefill worker, the rest from the decode worker.
        assert len(ours["choices"][0]["logprobs"]["tokens"]) == 6
        assert_same_completion_logprobs(ours["choices"][0]["logprobs"], ref["choices"][0]["logprobs"])
        assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert ours["usage"]["completion_tokens"] == ref["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_logprobs_and_top_logprobs_match_colocated(colocated_server, disaggregated_api, stream):
    args = dict(messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4)
    ref, _ = chat(colocated_server, False, **args)
    ours, headers = chat(disaggregated_api, stream, **args, stream_options={"include_usage": True} if stream else None)
    assert_disaggregated(headers, "chat with logprobs")
    assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
    assert_same_chat_logprobs(ours["choices"][0]["logprobs"], ref["choices"][0]["logprobs"])
    # The chat template is the model's own: the prompt has as many tokens as vLLM's.
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    # logprobs without top_logprobs: the chosen token's only.
    bare, _ = chat(disaggregated_api, stream, messages=CHAT, max_tokens=3, temperature=0, logprobs=True)
    content = bare["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(t["top_logprobs"] == [] for t in content)


def test_n_samples_prefill_the_prompt_once(colocated_server, disaggregated_api, spine_cluster):
    """n = 3: one prefill on the prefill worker, one KV push, one load on the decode worker; the
    two further samples find the prompt in the decode worker's prefix cache."""
    prompt = LONG_PROMPT + " A one-off ending for the n test."
    prefill, decode = spine_cluster.worker_urls["prefill"], spine_cluster.worker_urls["decode"]
    def kv_stats(worker: str) -> dict:
        return httpx.get(worker + "/internal/kv_stats", headers=spine_cluster.internal_headers).json()["stats"]

    before = [kv_stats(w) for w in (prefill, decode)]
    ours, headers = completion(disaggregated_api, False, prompt=prompt, max_tokens=5, temperature=0, n=3,
                               logprobs=1)
    after = [kv_stats(w) for w in (prefill, decode)]
    assert_disaggregated(headers, "n=3")
    prompt_tokens = ours["usage"]["prompt_tokens"]
    assert prompt_tokens > 2 * BLOCK
    assert after[0]["pushed_transfers"] == before[0]["pushed_transfers"] + 1
    assert after[1]["loaded_transfers"] == before[1]["loaded_transfers"] + 1
    assert int(headers["x-mooncake-decode-cached-tokens"]) == prompt_tokens
    siblings = [int(t) for t in headers["x-mooncake-sibling-cached-tokens"].split(",")]
    assert len(siblings) == 2 and all(t >= prompt_tokens - BLOCK for t in siblings), (siblings, prompt_tokens)
    # Greedy: every sample is the colocated answer, logprobs included. (vLLM's own server refuses
    # n > 1 with greedy sampling; OpenAI's API takes it, and so does this one.)
    ref, _ = completion(colocated_server, False, prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    assert [c["index"] for c in ours["choices"]] == [0, 1, 2]
    for mine in ours["choices"]:
        assert mine["text"] == ref["choices"][0]["text"]
        assert_same_completion_logprobs(mine["logprobs"], ref["choices"][0]["logprobs"])
    assert ours["usage"]["completion_tokens"] == 3 * ref["usage"]["completion_tokens"] == 15


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_n_samples_streamed_and_not_on_both_endpoints(colocated_server, disaggregated_api, stream):
    usage = {"include_usage": True} if stream else None
    greedy, headers = chat(disaggregated_api, stream, messages=CHAT, max_tokens=6, temperature=0, n=2,
                           stream_options=usage)
    assert_disaggregated(headers, "chat n=2")
    ref, _ = chat(colocated_server, False, messages=CHAT, max_tokens=6, temperature=0)
    assert [c["text"] for c in greedy["choices"]] == [ref["choices"][0]["text"]] * 2
    assert greedy["usage"]["completion_tokens"] == 2 * ref["usage"]["completion_tokens"]
    # Sampled: n independent answers (seeded, so the test is repeatable), counted in usage.
    sampled, _ = completion(disaggregated_api, stream, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=4,
                            stream_options=usage)
    texts = [c["text"] for c in sampled["choices"]]
    assert len(texts) == 4 and len(set(texts)) > 1, texts
    assert all(c["finish_reason"] in ("stop", "length") for c in sampled["choices"])
    assert sampled["usage"]["completion_tokens"] <= 32 and sampled["usage"]["completion_tokens"] >= 4


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_batched_prompts_match_colocated(colocated_server, disaggregated_api, stream):
    # A list of prompts (strings, or token-id lists) in one request, as stock vLLM takes it: each
    # prompt is a request of its own to the cluster; choice k * n + j is prompt k's sample j.
    prompts = [PROMPT, "Once upon a time, in a quiet village,", LONG_PROMPT]
    usage = {"include_usage": True} if stream else None
    ref, _ = completion(colocated_server, False, prompt=prompts, max_tokens=6, temperature=0, logprobs=1)
    # vLLM refuses greedy n > 1; ours answers it with n equal samples, so prompt k's are choices 2k, 2k + 1.
    ours, headers = completion(disaggregated_api, stream, prompt=prompts, max_tokens=6, temperature=0, n=2,
                               logprobs=1, stream_options=usage)
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in ref["choices"] for _ in range(2)]
    assert len(set(c["text"] for c in ours["choices"])) == 3
    for i, mine in enumerate(ours["choices"]):
        assert_same_completion_logprobs(mine["logprobs"], ref["choices"][i // 2]["logprobs"])
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    assert ours["usage"]["completion_tokens"] == 2 * ref["usage"]["completion_tokens"]
    for k, (prefill, decode) in enumerate(zip(headers["x-mooncake-prefill"].split(","),
                                              headers["x-mooncake-decode"].split(","), strict=True)):
        assert_disaggregated({"x-mooncake-prefill": prefill, "x-mooncake-decode": decode}, f"prompt {k}")
    ids = [[1, 2, 3, 4], [5, 6, 7]]  # token-id prompts batch the same way
    ref_ids, _ = completion(colocated_server, False, prompt=ids, max_tokens=4, temperature=0)
    ours_ids, _ = completion(disaggregated_api, stream, prompt=ids, max_tokens=4, temperature=0)
    assert [c["text"] for c in ours_ids["choices"]] == [c["text"] for c in ref_ids["choices"]]


def test_a_bad_prompt_in_a_batch_is_a_400_naming_it(disaggregated_api):
    r = httpx.post(f"{disaggregated_api}/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": [[1, 2], [3, 10**9]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt 1: "), r.text


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_matches_colocated(colocated_server, disaggregated_api, stream):
    ref, _ = completion(colocated_server, False, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    ours, headers = completion(disaggregated_api, stream, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                               logprobs=2)
    assert_disaggregated(headers, "echo")
    assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
    assert ours["choices"][0]["text"].startswith(PROMPT)
    # The prompt's logprobs (computed on the prefill worker), then the generated tokens'.
    assert ours["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert_same_completion_logprobs(ours["choices"][0]["logprobs"], ref["choices"][0]["logprobs"])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_an_echo_of_the_prompt_alone_scores_it_as_colocated(colocated_server, disaggregated_api, stream):
    """max_tokens 0 with echo: the prompt and its logprobs, nothing generated (vLLM's answer)."""
    ref, _ = completion(colocated_server, False, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    ours, _ = completion(disaggregated_api, stream, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    assert ours["choices"][0]["text"] == ref["choices"][0]["text"] == PROMPT
    assert ours["choices"][0]["finish_reason"] == "length"
    assert_same_completion_logprobs(ours["choices"][0]["logprobs"], ref["choices"][0]["logprobs"])
    if not stream:  # nothing generated is returned, so none is counted (vLLM counts the token it dropped)
        assert ours["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_match_colocated(colocated_server, disaggregated_api):
    ref = client(colocated_server).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                                      extra_body={"prompt_logprobs": 2})
    raw = client(disaggregated_api).completions.with_raw_response.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2})
    assert_disaggregated(raw.headers, "prompt_logprobs")
    ours = raw.parse().choices[0].model_extra["prompt_logprobs"]
    theirs = ref.choices[0].model_extra["prompt_logprobs"]
    assert ours[0] is None and theirs[0] is None and len(ours) == len(theirs) > 5
    for a, b in zip(ours[1:], theirs[1:]):
        assert set(a) == set(b)
        for token in a:
            assert a[token]["rank"] == b[token]["rank"] and a[token]["decoded_token"] == b[token]["decoded_token"]
            assert abs(a[token]["logprob"] - b[token]["logprob"]) <= TOLERANCE
    answer = client(disaggregated_api).chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    assert answer.model_extra["prompt_logprobs"][0] is None and len(answer.model_extra["prompt_logprobs"]) > 5


SCHEMA = {"type": "object", "properties": {"planet": {"type": "string"}, "moons": {"type": "integer"}},
          "required": ["planet", "moons"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_structured_outputs_match_colocated(colocated_server, disaggregated_api, stream):
    formats = ({"type": "json_schema", "json_schema": {"name": "planet", "schema": SCHEMA}}, {"type": "json_object"})
    for response_format in formats:
        args = dict(messages=[{"role": "user", "content": "Describe Mars as JSON."}], max_tokens=40, temperature=0,
                    response_format=response_format)
        ref, _ = chat(colocated_server, False, **args)
        ours, headers = chat(disaggregated_api, stream, **args)
        assert_disaggregated(headers, f"response_format {response_format['type']}")
        assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
        if ours["choices"][0]["finish_reason"] == "stop":
            value = json.loads(ours["choices"][0]["text"])
            assert isinstance(value, dict)
            if response_format["type"] == "json_schema":
                assert set(value) == {"planet", "moons"}
    ours, _ = completion(disaggregated_api, stream, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert ours["choices"][0]["text"] in ("yes", "no")
    ours, _ = completion(disaggregated_api, stream, prompt="A year:", max_tokens=8, temperature=0,
                         extra_body={"structured_outputs": {"regex": "(19|20)[0-9][0-9]"}})
    assert len(ours["choices"][0]["text"]) == 4 and ours["choices"][0]["text"][:2] in ("19", "20")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_strings_wait_for_min_tokens_as_colocated(colocated_server, disaggregated_api, stream):
    """Stop strings are the conductor's (the workers only see token limits): none may complete
    within the first min_tokens tokens, as vLLM's detokenizer rules."""
    args = dict(prompt="The capital of France is", max_tokens=16, temperature=0, stop=[".", ","])
    eager, _ = completion(colocated_server, False, **args)
    ref, _ = completion(colocated_server, False, **args, extra_body={"min_tokens": 6})
    assert ref["choices"][0]["text"] != eager["choices"][0]["text"], "min_tokens changed nothing: nothing tested"
    ours, headers = completion(disaggregated_api, stream, **args, extra_body={"min_tokens": 6})
    assert_disaggregated(headers, "the min_tokens answer")
    keys = ("text", "finish_reason", "stop_reason")
    assert [ours["choices"][0][k] for k in keys] == [ref["choices"][0][k] for k in keys]
    # Without min_tokens a stop string ended it (the texts differ): vLLM names it in stop_reason.
    assert eager["choices"][0]["finish_reason"] == "stop" and eager["choices"][0]["stop_reason"] in (".", ",")
    ours_eager, headers = completion(disaggregated_api, stream, **args)
    assert_disaggregated(headers, "the answer without min_tokens")
    assert [ours_eager["choices"][0][k] for k in keys] == [eager["choices"][0][k] for k in keys]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_stop_token_is_the_stop_reason_as_colocated(colocated_server, disaggregated_api, stream):
    """stop_token_ids end the answer on the engine (the conductor only sees the finish), and
    vLLM names the token in stop_reason; a plain EOS or length cut names nothing."""
    eager, _ = completion(colocated_server, False, prompt=PROMPT, max_tokens=8, temperature=0)
    assert eager["choices"][0]["finish_reason"] == "length" and eager["choices"][0]["stop_reason"] is None
    ids = httpx.post(f"{colocated_server.removesuffix('/v1')}/tokenize", timeout=60,
                     json={"prompt": eager["choices"][0]["text"], "add_special_tokens": False}).json()["tokens"]
    args = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"stop_token_ids": [ids[2]]})
    ref, _ = completion(colocated_server, False, **args)
    ours, headers = completion(disaggregated_api, stream, **args)
    assert_disaggregated(headers, "the stop_token_ids answer")
    assert ref["choices"][0]["finish_reason"] == "stop" and ref["choices"][0]["stop_reason"] == ids[2]
    assert [ours["choices"][0][k] for k in ("text", "finish_reason", "stop_reason")] == \
        [ref["choices"][0][k] for k in ("text", "finish_reason", "stop_reason")]
    plain, _ = completion(disaggregated_api, stream, prompt=PROMPT, max_tokens=8, temperature=0)
    assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["stop_reason"] is None


def test_usage_on_every_chunk_when_asked(disaggregated_api):
    stream = client(disaggregated_api).completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    parts = list(stream)
    # As vLLM: each chunk's usage is its own choice's tokens so far; the last chunk sums them.
    counts: dict[int, list[int]] = {}
    for p in parts:
        if p.choices:
            counts.setdefault(p.choices[0].index, []).append(p.usage.completion_tokens)
    assert all(p.usage is not None for p in parts) and sorted(counts) == [0, 1]
    assert all(c == sorted(c) and c[-1] == 4 for c in counts.values()), counts
    assert parts[-1].usage.completion_tokens == 8 and parts[-1].usage.prompt_tokens > 5


def test_unsupported_option_is_a_400_naming_it(disaggregated_api):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(disaggregated_api).chat.completions.create(model=MODEL_NAME, messages=CHAT, tools=[tool])
    assert info.value.body["code"] == "unsupported_option" and info.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as info:
        client(disaggregated_api).completions.create(model=MODEL_NAME, prompt=PROMPT, suffix="!")
    assert info.value.body["code"] == "unsupported_option" and info.value.body["param"] == "suffix"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_constraint_the_engine_cannot_compile_is_a_400_not_retried(disaggregated_api, stream):
    # The conductor cannot compile a regex or grammar; the decode worker's vLLM refuses it, and
    # that refusal is the client's error: a 400, not a retry on every worker ending in a 503.
    def retries() -> float:
        text = httpx.get(disaggregated_api.removesuffix("/v1") + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("mooncake_retries_total"))

    before = retries()
    for field, spec in (("guided_regex", "("), ("guided_grammar", "root ::= (")):
        with pytest.raises(openai.BadRequestError) as info:
            completion(disaggregated_api, stream, prompt=PROMPT, max_tokens=4, extra_body={field: spec})
        assert info.value.body["code"] == "invalid_value", info.value.body
        assert set(info.value.body) == {"message", "type", "param", "code"}
    assert retries() == before
    ours, _ = completion(disaggregated_api, stream, prompt="A year:", max_tokens=8, temperature=0,
                         extra_body={"guided_regex": "(19|20)[0-9][0-9]"})
    assert len(ours["choices"][0]["text"]) == 4  # the workers still serve


CONTINUED = [{"role": "user", "content": "Name two planets of the solar system."},
             {"role": "assistant", "content": "The two planets are Mars and"}]


def test_tokenize_and_detokenize_match_colocated(colocated_server, disaggregated_api):
    ours, ref = disaggregated_api.removesuffix("/v1"), colocated_server.removesuffix("/v1")
    bodies = [{"prompt": PROMPT, "return_token_strs": True},
              {"prompt": PROMPT, "add_special_tokens": False},
              {"model": MODEL_NAME, "messages": CHAT},
              {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True,
               "return_token_strs": True}]
    for body in bodies:
        mine = httpx.post(f"{ours}/tokenize", json=body, timeout=60)
        theirs = httpx.post(f"{ref}/tokenize", json=body, timeout=60)
        assert mine.status_code == theirs.status_code == 200, (mine.text, theirs.text)
        assert mine.json() == theirs.json(), body
    ids = httpx.post(f"{ours}/tokenize", json={"messages": CHAT}, timeout=60).json()["tokens"]
    mine, theirs = (httpx.post(f"{base}/detokenize", json={"tokens": ids}, timeout=60) for base in (ours, ref))
    assert mine.json() == theirs.json() and "planets" in mine.json()["prompt"]
    bad = httpx.post(f"{ours}/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"{ours}/tokenize", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert unknown.status_code == 404


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_continuing_the_final_message_matches_colocated(colocated_server, disaggregated_api, stream):
    # The assistant's last message is left open and continued, with the template's own variables
    # passed through: the prompt and the greedy answer are stock vLLM's.
    options = {"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    ref, _ = chat(colocated_server, False, messages=CONTINUED, max_tokens=8, temperature=0, extra_body=options)
    ours, headers = chat(disaggregated_api, stream, messages=CONTINUED, max_tokens=8, temperature=0,
                         extra_body=options, stream_options={"include_usage": True} if stream else None)
    assert_disaggregated(headers, "continued chat")
    assert ours["choices"][0]["text"] == ref["choices"][0]["text"]
    assert ours["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    closed, _ = chat(disaggregated_api, False, messages=CONTINUED, max_tokens=8, temperature=0)
    assert closed["usage"]["prompt_tokens"] > ref["usage"]["prompt_tokens"]  # a new turn was opened there


@pytest.mark.parametrize("body,param", [
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
])
def test_chat_template_options_that_cannot_be_honoured_are_400s(disaggregated_api, body, param):
    r = httpx.post(f"{disaggregated_api}/chat/completions", timeout=60,
                   json={"model": MODEL_NAME, "messages": CONTINUED, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert param in r.text
