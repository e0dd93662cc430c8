"""Per-request priority and SLOs on the real cluster, with the official client: a request whose own
TTFT SLO cannot be met is refused (429) while the same prompt in the default class is served; bad
values are 400s naming the field; a named class is served and every metric carries its class."""

import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.e2e.test_errors import assert_openai_error, metric_sum

pytestmark = pytest.mark.vllm


def fresh_prompt(words: int) -> str:
    """~4 tokens a word, never seen by the prefix caches (its first block is new, so every block
    is: a cached prompt would be predicted fast)."""
    return uuid.uuid4().hex + " " + " ".join(f"w{i}" for i in range(words))


def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key="x", max_retries=0)


def test_a_ttft_slo_of_its_own_that_cannot_be_met_is_refused_while_the_default_class_is_served(spine_cluster):
    """~1.1k fresh prompt tokens: seconds of prefill by the profile, a quarter of a second even if
    the calibration has learnt this cluster is 10x faster (its limit); never within 100 ms."""
    metrics = spine_cluster.base_url + "/metrics"
    before = httpx.get(metrics).text
    c = client(spine_cluster.api)
    messages = [{"role": "user", "content": fresh_prompt(300)}]
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                  extra_headers={"X-Mooncake-SLO-TTFT-Ms": "100"})
    err = info.value.body
    assert err["code"] == "ttft_slo" and "within 0.10 s" in err["message"] and "class default" in err["message"]
    assert int(info.value.response.headers["retry-after"]) > 0
    served = c.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                                         temperature=0, extra_body={"priority": 5})
    assert served.headers["x-mooncake-slo-class"] == "default"
    assert served.parse().usage.completion_tokens == 2
    text = httpx.get(metrics).text

    def delta(prefix: str) -> float:
        return metric_sum(text, prefix) - metric_sum(before, prefix)

    assert delta('mooncake_rejections_total{reason="ttft_slo",slo_class="default"}') == 1
    assert delta('mooncake_requests_total{endpoint="chat",slo_class="default",status="429"}') == 1
    assert delta('mooncake_requests_total{endpoint="chat",slo_class="default",status="200"}') == 1
    assert delta('mooncake_time_to_first_token_seconds_count{slo_class="default"}') == 1
    assert delta('mooncake_request_latency_seconds_count{slo_class="default"}') == 1


@pytest.mark.parametrize("extra, param, code", [
    ({"extra_headers": {"X-Mooncake-SLO-TTFT-Ms": "50"}}, "X-Mooncake-SLO-TTFT-Ms", "slo_out_of_bounds"),
    ({"extra_headers": {"X-Mooncake-SLO-TBT-Ms": "100"}}, "X-Mooncake-SLO-TBT-Ms", "slo_out_of_bounds"),
    ({"extra_body": {"mooncake_slo": {"ttft_ms": 10}}}, "mooncake_slo.ttft_ms", "slo_out_of_bounds"),
    ({"extra_body": {"priority": -1}}, "priority", "priority_out_of_bounds"),
    ({"extra_headers": {"X-Mooncake-Priority": "soon"}}, "X-Mooncake-Priority", "invalid_value"),
    ({"extra_headers": {"X-Mooncake-SLO-Class": "gold"}}, "X-Mooncake-SLO-Class", "unknown_slo_class"),
])
def test_values_outside_the_operators_bounds_are_400_naming_the_field(spine_cluster, extra, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client(spine_cluster.api).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, **extra)
    assert info.value.body["param"] == param and info.value.body["code"] == code, info.value.body


def test_bad_body_values_are_400_and_an_unknown_class_is_counted_as_unknown(spine_cluster):
    resp = httpx.post(spine_cluster.api + "/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "mooncake_slo": {"ttft_ms": "fast"}})
    assert assert_openai_error(resp, 400)["param"] == "mooncake_slo.ttft_ms"
    resp = httpx.post(spine_cluster.api + "/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "mooncake_slo": {"deadline_ms": 5}})
    assert assert_openai_error(resp, 400)["param"] == "mooncake_slo.deadline_ms"
    before = httpx.get(spine_cluster.base_url + "/metrics").text
    resp = httpx.post(spine_cluster.api + "/completions", timeout=60, headers={"X-Mooncake-SLO-Class": "x" * 40},
                      json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
    assert_openai_error(resp, 400, "unknown_slo_class")
    text = httpx.get(spine_cluster.base_url + "/metrics").text
    line = 'mooncake_requests_total{endpoint="completions",slo_class="unknown",status="400"}'
    assert metric_sum(text, line) - metric_sum(before, line) == 1
    assert "x" * 40 not in text  # a client's string never becomes a label


def test_a_named_class_is_served_and_its_metrics_carry_it(disaggregated_api):
    """The second conductor has the operator class batch (600 s TTFT, 2 s TBT, priority 5)."""
    metrics = disaggregated_api.removesuffix("/v1") + "/metrics"
    before = httpx.get(metrics).text
    c = client(disaggregated_api)
    stream = c.completions.create(model=MODEL_NAME, prompt=fresh_prompt(40), max_tokens=4, temperature=0,
                                  stream=True, extra_headers={"X-Mooncake-SLO-Class": "batch"})
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
    text = ""

    def delta(prefix: str) -> float:
        return metric_sum(text, prefix) - metric_sum(before, prefix)

    deadline = time.monotonic() + 30  # a streamed answer is counted when its response has ended
    while time.monotonic() < deadline:
        text = httpx.get(metrics).text
        if delta('mooncake_request_latency_seconds_count{slo_class="batch"}') >= 1:
            break
        time.sleep(0.2)

    assert delta('mooncake_requests_total{endpoint="completions",slo_class="batch",status="200"}') == 1
    assert delta('mooncake_time_to_first_token_seconds_count{slo_class="batch"}') == 1
    assert delta('mooncake_time_between_tokens_seconds_count{slo_class="batch"}') >= 1
    assert delta('mooncake_request_latency_seconds_count{slo_class="batch"}') == 1
