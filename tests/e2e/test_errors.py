"""Bad input gets an OpenAI-style error with the right status, and loses nothing: the cluster
still answers correctly afterwards."""

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.processes import free_port, start, wait_http, wait_workers_seen

pytestmark = pytest.mark.vllm


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    return err


def test_worker_not_up_yet_is_503_with_retry_after(spine_cluster):
    early = spine_cluster.early
    assert early["status"] == 503, early
    assert early["body"]["error"]["code"] == "workers_unavailable"
    assert int(early["headers"]["retry-after"]) > 0


def test_prompt_longer_than_context_is_400(spine_cluster):
    resp = httpx.post(spine_cluster.api + "/completions", json={
        "model": MODEL_NAME, "prompt": "word " * 9000, "max_tokens": 4}, timeout=60)
    assert_openai_error(resp, 400, "context_length_exceeded")
    resp = httpx.post(spine_cluster.api + "/completions", json={
        "model": MODEL_NAME, "prompt": "hi", "max_tokens": 100_000}, timeout=60)
    assert_openai_error(resp, 400, "context_length_exceeded")


def test_unknown_model_is_404(spine_cluster):
    client = openai.OpenAI(base_url=spine_cluster.api, api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "model_not_found"
    assert_openai_error(httpx.get(spine_cluster.api + "/models/gpt-17"), 404)


@pytest.mark.parametrize("body,param", [
    ('{"model": "x", "prompt": ', None),                              # malformed JSON
    ('{"model": "%s"}' % MODEL_NAME, "prompt"),                         # missing field
    ('{"model": "%s", "messages": []}' % MODEL_NAME, "messages"),       # empty list
    ('{"model": "%s", "prompt": "a", "temperature": 9}' % MODEL_NAME, "temperature"),
    ('{"model": "%s", "prompt": "a", "max_tokens": 0}' % MODEL_NAME, "max_tokens"),
    ('{"model": "%s", "prompt": "a", "stream_options": {"include_usage": true}}' % MODEL_NAME, "stream_options"),
    ('[1, 2]', None),
    # 0 in the engine's float32 (vLLM's grammar then rejects its own sample: a 500 from stock vLLM)
    ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 5e-324, '
     '"structured_outputs": {"choice": ["0"]}}' % MODEL_NAME, "repetition_penalty"),
    # past int64 vLLM fails it on every worker (retried between them for ever, once)
    ('{"model": "%s", "prompt": "a", "top_k": 18446744073709551616}' % MODEL_NAME, "top_k"),
    # a choice SmolLM2's byte-level vocabulary cannot write (U+40000): vLLM's grammar cannot be met
    ('{"model": "%s", "prompt": "a", "guided_choice": ["\\ud8c0\\udc00"]}' % MODEL_NAME, "guided_choice"),
])
def test_malformed_requests_are_400(spine_cluster, body, param):
    path = "/chat/completions" if "messages" in body else "/completions"
    resp = httpx.post(spine_cluster.api + path, content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(resp, 400)
    if param:
        assert err["param"] == param


def test_a_lone_surrogate_is_a_400_and_the_connection_stays_usable(spine_cluster):
    """JSON may spell "\\ud800", which no UTF-8 text holds: the tokenizer would raise on it. Before
    this was checked it was a plain-text 500 that also dropped the client's connection."""
    with httpx.Client(base_url=spine_cluster.api, timeout=120) as client:  # one keep-alive connection
        for path, body in [("/completions", '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL_NAME),
                           ("/chat/completions", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
                            '"content": [{"type": "text", "text": "x\\udc00"}]}]}' % MODEL_NAME)]:
            err = assert_openai_error(client.post(path, content=body, headers={"content-type": "application/json"}),
                                      400)
            assert "surrogate" in err["message"], err
        ok = client.post("/completions", json={"model": MODEL_NAME, "prompt": "The capital of France is",
                                               "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["text"], ok.text


def test_unsupported_options_are_refused_not_ignored(spine_cluster):
    for extra, param in (({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"best_of": 2}, "best_of"),
                         ({"prompt": [[1], [10**9]]}, "prompt"), ({"prompt": [10**9]}, "prompt"),
                         ({"logit_bias": {"99999999": 5}}, "logit_bias"), ({"logit_bias": {"1": 500}}, "logit_bias"),
                         ({"suffix": "z"}, "suffix"), ({"top_logprobs": 2}, "top_logprobs"),
                         ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")):
        body = {"model": MODEL_NAME, "prompt": "a", **extra}
        err = assert_openai_error(httpx.post(spine_cluster.api + "/completions", json=body), 400)
        assert err["param"] == param
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for extra, param in (({"tools": [tool]}, "tools"), ({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"echo": True}, "echo"),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex")):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], **extra}
        err = assert_openai_error(httpx.post(spine_cluster.api + "/chat/completions", json=body), 400)
        assert err["param"] == param


def test_oversized_body_is_413(spine_cluster):
    resp = httpx.post(spine_cluster.api + "/completions", content=b"x" * (17 << 20),
                      headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(resp, 413)


def test_models_lists_served_model_with_root(spine_cluster, model_path):
    models = openai.OpenAI(base_url=spine_cluster.api, api_key="x").models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["root"] == model_path


def test_cluster_still_serves_after_bad_input(spine_cluster):
    client = openai.OpenAI(base_url=spine_cluster.api, api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    health = httpx.get(spine_cluster.base_url + "/health").json()
    assert health["status"] == "ok"
    for role, url in spine_cluster.worker_urls.items():
        assert httpx.get(url + "/internal/load", headers=spine_cluster.internal_headers).json()["running_requests"] == 0, role


def test_decode_only_conductor_runs_prompts_colocated_under_the_same_slo(spine_cluster, model_path, log_dir):
    """A conductor that knows no prefill worker (none configured, or all down) prefills on the
    decode worker, through the scheduling core: served when it fits the SLO, 429 when not."""
    def conductor(name: str, *extra: str):
        port = free_port()
        proc = start(name, ["-m", "mooncake.cli", "conductor", "--port", str(port), "--model", model_path,
                            "--served-model-name", MODEL_NAME, "--decode-url", spine_cluster.worker_urls["decode"],
                            "--cluster-token-file", spine_cluster.token_file, *extra], log_dir)
        wait_http(proc, f"http://127.0.0.1:{port}/health", 120)
        return proc, f"http://127.0.0.1:{port}"

    proc, base = conductor("conductor-decode-only")
    strict, strict_base = conductor("conductor-decode-only-strict", "--ttft-slo", "0.05", "--refuse-unattainable")
    try:
        for b in (base, strict_base):  # until the conductor's health poll has seen the worker ready
            wait_workers_seen(b, role="decode")
        ok = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200, ok.text
        assert "Paris" in ok.json()["choices"][0]["text"]
        assert ok.headers["x-mooncake-prefill"] == ok.headers["x-mooncake-decode"]
        # This conductor is fresh (its own process): its one request is its one colocated route.
        assert metric_sum(httpx.get(base + "/metrics").text, 'mooncake_routes_total{kind="colocated"}') == 1
        # A prompt computed colocated reports the prefix its worker found cached, as a disaggregated one does.
        shared = {"model": MODEL_NAME, "prompt": "Cached on the decode worker: " + "north wind, " * 300,
                  "max_tokens": 2, "temperature": 0}
        httpx.post(base + "/v1/completions", timeout=120, json=shared).raise_for_status()
        again = httpx.post(base + "/v1/completions", timeout=120, json=shared)
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 128 and again.headers["x-mooncake-cached-tokens"] == str(cached), again.headers
        refused = httpx.post(strict_base + "/v1/completions", timeout=120, json={
            "model": MODEL_NAME, "prompt": "word " * 1500, "max_tokens": 4, "temperature": 0})
        err = assert_openai_error(refused, 429, "ttft_slo")
        assert "retrying will not help" in err["message"], err  # --refuse-unattainable: the paper's rule
        assert int(refused.headers["retry-after"]) >= 1
    finally:
        proc.stop()
        strict.stop()


def metric_sum(text: str, prefix: str) -> float:
    """Sum of the samples whose line starts with `prefix` (0 when there is none yet)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_metrics_have_units_and_count_requests(spine_cluster):
    # The cluster is shared by the session and tests run in random order: compare before/after
    # deltas of this test's own requests, never totals that earlier tests may have moved.
    metrics = spine_cluster.base_url + "/metrics"
    before = httpx.get(metrics).text
    served = httpx.post(spine_cluster.base_url + "/v1/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "One, two, three,", "max_tokens": 2, "temperature": 0})
    assert served.status_code == 200, served.text
    # Refused by the conductor itself, and by request validation before its handler: both counted.
    bad = httpx.post(spine_cluster.api + "/completions", timeout=60,
                     json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 100_000})
    assert_openai_error(bad, 400, "context_length_exceeded")
    invalid = httpx.post(spine_cluster.api + "/completions", timeout=60,
                         json={"model": MODEL_NAME, "prompt": "hi", "n": 0})
    assert_openai_error(invalid, 400, "invalid_value")
    text = httpx.get(metrics).text
    assert "mooncake_time_to_first_token_seconds_bucket" in text

    def delta(prefix: str) -> float:
        return metric_sum(text, prefix) - metric_sum(before, prefix)

    assert delta("mooncake_ttft_prediction_ratio_count") >= 1
    assert delta('mooncake_requests_total{endpoint="completions",slo_class="default",status="200"}') == 1
    assert delta('mooncake_requests_total{endpoint="completions",slo_class="default",status="400"}') == 2
    # The served request was routed one way or the other; the refused one was not routed.
    assert delta("mooncake_routes_total{kind=") == 1
    # The worker's text comes from prometheus_client: parse it rather than match its number format.
    worker = httpx.get(spine_cluster.worker_urls["decode"] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(worker)}
    loaded = families["mooncake_kv_loaded_bytes"]  # the connector answered the control call
    assert loaded.type == "counter" and [s.name for s in loaded.samples] == ["mooncake_kv_loaded_bytes_total"]
    assert loaded.samples[0].value >= 0
    assert families["mooncake_worker_running_requests"].type == "gauge"


def test_unknown_fields_are_ignored_not_refused(spine_cluster):
    client = openai.OpenAI(base_url=spine_cluster.api, api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0,
                                  extra_body={"some_future_field": {"x": 1}})
    assert r.usage.completion_tokens == 2


def test_conductor_measures_each_prefill_workers_push_bandwidth(disaggregated_api):
    """The scheduler prices transfers with the bandwidth measured from the worker's own pushes.
    Through the fixed-roles conductor: with flexible roles a request may be served whole on one
    worker, and then nothing is pushed."""
    base = disaggregated_api.removesuffix("/v1")
    words = " ".join(f"item{i}" for i in range(600))  # ~2.3k tokens, ~100 MB of KV in float32
    resp = httpx.post(disaggregated_api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": words, "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-mooncake-prefill"] != resp.headers["x-mooncake-decode"]  # it was pushed
    deadline = time.monotonic() + 120  # generous: the measurement arrives with a load report
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health").json()
        measured = {w["role"]: w["kv_push_bandwidth_Bps"] for w in health["workers"]}
        if measured.get("prefill"):
            break
        time.sleep(0.5)
    assert measured.get("prefill", 0) > 1e6, health["workers"]  # bytes/s; loopback TCP moves far more
    text = httpx.get(base + "/metrics").text
    assert "mooncake_kv_push_bandwidth_bytes_per_second{instance=" in text


def test_request_that_cannot_meet_the_ttft_slo_even_on_an_idle_cluster_is_served_best_effort_when_idle(
        spine_cluster, model_path, log_dir):
    """~5k prompt tokens take seconds to prefill on these cores whatever the calibration has
    learned, so they miss a 2 s TTFT SLO even on an idle cluster. By default such a request is
    served, best effort, when the worker that would prefill it has nothing queued (a legal request
    must be servable); --refuse-unattainable refuses it for good (the decode-only test above).
    (Its own conductor: the shared one's SLO is 30 s, which a calibrated cluster may meet.)"""
    port = free_port()
    proc = start("conductor-strict-ttft", [
        "-m", "mooncake.cli", "conductor", "--port", str(port), "--model", model_path,
        "--served-model-name", MODEL_NAME, "--prefill-url", spine_cluster.worker_urls["prefill"],
        "--decode-url", spine_cluster.worker_urls["decode"], "--ttft-slo", "2",
        "--cluster-token-file", spine_cluster.token_file], log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(proc, base + "/health", 120)
        wait_workers_seen(base)
        words = " ".join(f"item{i}" for i in range(1700))
        resp = httpx.post(base + "/v1/completions", timeout=300, json={
            "model": MODEL_NAME, "prompt": words, "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-mooncake-best-effort"] == "true"
        assert int(resp.headers["x-mooncake-predicted-ttft-ms"]) > 2000
        assert metric_sum(httpx.get(base + "/metrics").text, "mooncake_best_effort_admissions_total") == 1
    finally:
        proc.stop()
