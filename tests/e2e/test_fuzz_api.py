"""Property-based fuzzing (Schemathesis) of the conductor's public API, from its own OpenAPI
schema, against the real cluster: valid and schema-violating requests alike get no 5xx, no hang,
and every error in OpenAI's shape. Internal routes, called without the cluster token, are all
refused.

Bounded for CI: a few dozen examples per operation, at most 4 generated tokens per request
(tighter bounds in the schema for valid cases; over-large token counts the server would serve
are clamped before sending), a per-call timeout, and a time cap on the whole test.
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
TOTAL_BUDGET_S = 90.0
MAX_TOKENS = 4
EXAMPLES = {"/v1/completions": 30, "/v1/chat/completions": 30}
OTHER_EXAMPLES = 8
UNSUPPORTED = ("best_of", "logprobs", "top_logprobs", "prompt_logprobs", "tools", "tool_choice", "functions",
               "function_call", "response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs", "echo", "suffix")


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
        # Options the server refuses by design (400 unsupported_option, tested in test_errors.py)
        # would end most valid cases before they reach a worker.
        props = bodies[name]["properties"]
        for field in UNSUPPORTED:
            props.pop(field, None)
        props["n"] = {"type": "integer", "enum": [1]}
        props["logit_bias"] = {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 4,
                               "propertyNames": {"pattern": "^[0-9]{1,5}$"},
                               "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]}
        bodies[name]["additionalProperties"] = False
    return schema


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


@pytest.fixture(scope="module")
def deadline():
    return time.monotonic() + TOTAL_BUDGET_S


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
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
def test_no_5xx_no_hang_and_openai_errors(api_schema, spine_cluster, deadline, method, path, mode):
    operation = api_schema[path][method]
    examples = EXAMPLES.get(path, OTHER_EXAMPLES)
    statuses: Counter[int] = Counter()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        if time.monotonic() > deadline:
            return  # the whole test's time cap: later operations get fewer examples
        case.body = clamp(case.body)
        started = time.monotonic()
        response = case.call(base_url=spine_cluster.base_url, timeout=CALL_TIMEOUT_S)
        statuses[response.status_code] += 1
        check(case, response, started)

    fuzz()
    print(f"{method} {path} {mode.value}: answers by status {dict(statuses)}")
    if mode == GenerationMode.POSITIVE and path in EXAMPLES and time.monotonic() < deadline:
        assert statuses[200] >= 3, f"valid cases hardly reached the engine: {dict(statuses)}"
    # Whatever the fuzzer sent, the cluster still answers a plain request.
    resp = httpx.post(spine_cluster.api + "/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
