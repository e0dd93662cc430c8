"""Flexible roles on real engines: a prefill-labelled worker decodes whole requests when the
scheduler puts them there, and the text equals the same request served disaggregated.

Deterministic, not load-dependent: the conductor under test knows only the spine cluster's
prefill worker, so with flexible roles (the default) every request must be served whole there;
with fixed roles the same conductor would have no decode worker at all."""


import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.e2e.test_errors import metric_sum
from tests.processes import free_port, start, wait_http

pytestmark = pytest.mark.vllm
PROMPTS = [" ".join(f"topic{n} word{i}" for i in range(150 + 7 * n)) for n in range(3)]  # ~0.5 k tokens each


def complete(api: str, prompt: str) -> httpx.Response:
    resp = httpx.post(api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp


def test_a_prefill_worker_serves_whole_requests_with_identical_text(spine_cluster, disaggregated_api,
                                                                     model_path, log_dir):
    reference = {p: complete(disaggregated_api, p) for p in PROMPTS}
    prefill_id = next(iter(reference.values())).headers["x-mooncake-prefill"]
    for r in reference.values():
        assert r.headers["x-mooncake-prefill"] != r.headers["x-mooncake-decode"]  # fixed roles: pushed
    port = free_port()
    proc = start("conductor-prefill-only", ["-m", "mooncake.cli", "conductor", "--port", str(port),
                                            "--model", model_path, "--served-model-name", MODEL_NAME,
                                            "--prefill-url", spine_cluster.worker_urls["prefill"],
                                            "--cluster-token-file", spine_cluster.token_file], log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(proc, base + "/health", 120)  # 200 only once the prefill worker is seen ready
        for p in PROMPTS:
            r = complete(base + "/v1", p)
            assert r.headers["x-mooncake-prefill"] == r.headers["x-mooncake-decode"] == prefill_id
            assert r.json()["choices"][0]["text"] == reference[p].json()["choices"][0]["text"]
        # A fresh conductor: its requests are exactly its colocated routes.
        assert metric_sum(httpx.get(base + "/metrics").text, 'mooncake_routes_total{kind="colocated"}') == len(PROMPTS)
    finally:
        proc.stop()
