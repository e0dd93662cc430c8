"""Property-based fuzzing (Schemathesis) of the conductor's public API, from its own OpenAPI
schema, against the real cluster: valid and schema-violating requests alike get no 5xx, no hang,
and every error in OpenAI's shape. Internal routes, called without the cluster token, are all
refused.

Bounded for CI: a few dozen examples per operation, at most 4 generated tokens per request
(tighter bounds in the schema for valid cases; over-large token counts the server would serve
are clamped before sending), a per-call timeout, and a time budget per operation (each sends at
least one request, whatever order the cases run in).
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from mooncake import defaults
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm

CALL_TIMEOUT_S = 60.0
"""No answer (or stream) within this is a hang: 4 tokens take well under a second."""
CASE_BUDGET_S = {"/v1/completions": 30.0, "/v1/chat/completions": 30.0}
"""Per case (operation and mode): past it no further example is sent."""
OTHER_BUDGET_S = 15.0
MAX_TOKENS = 4
EXAMPLES = {"/v1/completions": 30, "/v1/chat/completions": 30}
OTHER_EXAMPLES = 8
# Options the server does not implement (400 unsupported_option, tested in test_errors.py and
# test_openai_params.py): they would end most valid cases before they reach a worker.
UNSUPPORTED = ("best_of", "tools", "tool_choice", "functions", "function_call", "suffix", "include_stop_str_in_output",
               "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words",
               "truncate_prompt_tokens", "logits_processors", "use_beam_search", "length_penalty",
               "return_tokens_as_token_ids", "logprob_token_ids", "reasoning_effort", "documents",
               "thinking_token_budget", "repetition_detection", "watermarking", "truncation_side", "return_token_ids")
# The other endpoint's, and a request's own chat template (refused: code the server would run).
UNSUPPORTED_ON = {"CompletionRequest": ("top_logprobs",), "ChatCompletionRequest": ("echo", "chat_template")}
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
NULL = {"type": "null"}


def one_of(*values) -> dict:
    return {"anyOf": [NULL, *({"const": v} for v in values)]}


def bounded_schema(raw: dict) -> dict:
    """The conductor's schema, with valid cases kept cheap: the served model, a few tokens, short
    prompts. It still describes the real request bodies (pydantic's)."""
    schema = copy.deepcopy(raw)
    bodies = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = bodies[name]["properties"]
        props["model"] = {"type": "string", "enum": [MODEL_NAME]}
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if field in props:
                props[field] = {"type": "integer", "minimum": 1 if field != "min_tokens" else 0, "maximum": MAX_TOKENS}
        bodies[name]["required"] = sorted({*bodies[name].get("required", []), "max_tokens"})
    bodies["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        {"type": "string", "minLength": 1, "maxLength": 200},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 49151}, "minItems": 1, "maxItems": 16}]}
    bodies["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 4
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = bodies[name]["properties"]
        for field in (*UNSUPPORTED, *UNSUPPORTED_ON[name]):
            props.pop(field, None)
        # Several samples, logprobs and structured outputs, within what a CPU answers quickly.
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 3}
        props["logit_bias"] = {"anyOf": [NULL, {"type": "object", "maxProperties": 4,
                               "propertyNames": {"pattern": "^[0-9]{1,5}$"},
                               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]}
        props["prompt_logprobs"] = {"anyOf": [NULL, {"type": "integer", "minimum": 0, "maximum": 5}]}
        props["response_format"] = one_of({"type": "text"}, {"type": "json_object"},
                                          {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
        props["guided_json"] = one_of(SCHEMA, json.dumps(SCHEMA))
        props["guided_regex"] = one_of("[0-9]+", "(yes|no)")
        props["guided_choice"] = {"anyOf": [NULL, {"type": "array", "minItems": 1, "maxItems": 3,
                                                   "items": {"type": "string", "minLength": 1, "maxLength": 8}}]}
        props["guided_grammar"] = one_of('root ::= "a" | "b"')
        props["structured_outputs"] = one_of({"regex": "[a-z]+"}, {"choice": ["x", "y"]}, {"json_object": True})
        bodies[name]["additionalProperties"] = False
    bodies["CompletionRequest"]["properties"]["logprobs"] = {"anyOf": [NULL, {"type": "integer", "minimum": 0,
                                                                              "maximum": 5}]}
    bodies["ChatCompletionRequest"]["properties"]["top_logprobs"] = {"anyOf": [NULL, {"type": "integer",
                                                                                      "minimum": 0, "maximum": 5}]}
    return schema


def valid_together(body):
    """A valid case made to keep the rules between fields that the schema cannot say, so it reaches
    a worker: one structured-output constraint at most, top_logprobs with logprobs, no
    prompt_logprobs in a stream, stream_options only with a stream, no generation prompt after a
    message left open."""
    if not isinstance(body, dict):
        return body
    for field in [f for f in STRUCTURED if body.get(f) is not None][1:]:
        del body[field]
    if body.get("top_logprobs") is not None and "messages" in body:
        body["logprobs"] = True
    if body.get("prompt_logprobs") is not None and body.get("stream"):
        body["stream"] = False
    if body.get("stream_options") and not body.get("stream"):  # as vLLM: options only for a stream
        del body["stream_options"]
    if body.get("continue_final_message"):  # as vLLM: not both
        body["add_generation_prompt"] = False
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(most, int) and (body.get("min_tokens") or 0) > most:  # as vLLM: min_tokens <= max_tokens
        body["min_tokens"] = most
    return body


def clamp(body):
    """A schema-violating case may still ask for thousands of tokens the server would generate
    (valid for it, but minutes on CPU): cap those; out-of-range values stay, to be refused."""
    if not isinstance(body, dict):
        return body
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value <= defaults.MAX_MODEL_LEN:
            body[field] = MAX_TOKENS
    if "messages" in body and not body.get("max_tokens") and not body.get("max_completion_tokens"):
        body["max_tokens"] = MAX_TOKENS  # a chat's default is the whole context
    return body


def assert_openai_error(payload, where: str) -> None:
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), where
    error = payload["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], where


def check(case, response, started: float) -> None:
    where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:500]} -> {response.status_code}"
    assert time.monotonic() - started < CALL_TIMEOUT_S, f"hang: {where}"
    assert response.status_code < 500, f"{where}: {response.text[:500]}"
    if case.path.startswith("/internal/"):
        assert response.status_code == 401, f"internal route without the cluster token: {where}"
    if response.status_code >= 400:
        assert_openai_error(response.json(), where)
    elif "text/event-stream" in str(response.headers.get("content-type")):  # Schemathesis: a list of values
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"error"' in line:
                assert_openai_error(json.loads(line[6:]), where)


@pytest.fixture(scope="module")
def api_schema(spine_cluster):
    raw = httpx.get(spine_cluster.base_url + "/openapi.json", timeout=10).json()
    return schemathesis.openapi.from_dict(bounded_schema(raw))


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/internal/debug/estimators"), ("GET", "/internal/registry/instances"),
              ("POST", "/internal/registry/instances"),
              ("POST", "/internal/registry/instances/{instance_id}/heartbeat"),
              ("DELETE", "/internal/registry/instances/{instance_id}")]


CASES = [(method, path, mode) for method, path in OPERATIONS
         # Only the request bodies have anything to violate; the other operations take no input.
         for mode in ([GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if method == "POST" and path.startswith("/v1")
                      else [GenerationMode.POSITIVE])]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {g.value}" for m, p, g in CASES])
def test_no_5xx_no_hang_and_openai_errors(api_schema, spine_cluster, method, path, mode):
    operation = api_schema[path][method]
    examples = EXAMPLES.get(path, OTHER_EXAMPLES)
    statuses: Counter[int] = Counter()
    deadline = time.monotonic() + CASE_BUDGET_S.get(path, OTHER_BUDGET_S)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        if statuses and time.monotonic() > deadline:
            return  # this case's time is up: the examples left are skipped
        case.body = clamp(case.body)
        if mode == GenerationMode.POSITIVE:
            case.body = valid_together(case.body)
        started = time.monotonic()
        response = case.call(base_url=spine_cluster.base_url, timeout=CALL_TIMEOUT_S)
        statuses[response.status_code] += 1
        check(case, response, started)

    fuzz()
    print(f"{method} {path} {mode.value}: answers by status {dict(statuses)}")
    assert statuses, "no request was sent"  # e.g. internal routes' 401 checks never ran
    if mode == GenerationMode.POSITIVE and path in EXAMPLES:
        assert statuses[200] >= 3, f"valid cases hardly reached the engine: {dict(statuses)}"
    # Whatever the fuzzer sent, the cluster still answers a plain request.
    resp = httpx.post(spine_cluster.api + "/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
