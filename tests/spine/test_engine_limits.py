"""Sampling values the engine would refuse are refused by the conductor's schema (a 400 naming
the field), never sent to a worker: found by the fuzzer (tests/e2e/test_fuzz_api.py), where a
worker's refusal became a retry on every worker and a 503."""

import pytest
from pydantic import ValidationError

from conductor.schemas import ChatCompletionRequest, CompletionRequest


@pytest.mark.parametrize("field,value", [
    ("top_k", -2), ("top_k", 2**64), ("min_p", -0.1), ("min_p", 1.5), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("stop_token_ids", [5, -1]), ("repetition_penalty", float("inf")), ("temperature", float("nan")),
    ("presence_penalty", float("-inf")),
    # 0 in the engine's float32: a structured output's masked logits times 0 are NaN, and vLLM's
    # grammar then rejects the token it sampled (a 500 from stock vLLM too).
    ("repetition_penalty", 5e-324), ("repetition_penalty", 2.0**-150),
])
def test_values_the_engine_refuses_are_400s_here(field, value):
    for model, extra in ((CompletionRequest, {"prompt": "hi"}),
                         (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(ValidationError) as info:
            model(model="m", **extra, **{field: value})
        assert info.value.errors()[0]["loc"][0] == field


def test_the_engine_limits_themselves_pass():
    body = CompletionRequest(model="m", prompt="hi", top_k=-1, min_p=1.0, seed=-(2**63), stop_token_ids=[0])
    assert (body.top_k, body.min_p, body.seed, body.stop_token_ids) == (-1, 1.0, -(2**63), [0])
    assert CompletionRequest(model="m", prompt="hi", repetition_penalty=2.0**-149).repetition_penalty == 2.0**-149
