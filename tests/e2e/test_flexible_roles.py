"""Flexible roles on real engines: `mooncake serve` (flexible roles by default) serves some of a
burst whole on the prefill worker, and the text equals the same request served disaggregated."""

import concurrent.futures

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.e2e.test_openai_exact import disaggregated_api  # noqa: F401  (fixture: fixed roles, always P != D)

pytestmark = pytest.mark.vllm
WORDS = [" ".join(f"topic{n} word{i}" for i in range(150 + 7 * n)) for n in range(6)]  # ~0.5-0.7k tokens each


def complete(api: str, prompt: str) -> httpx.Response:
    resp = httpx.post(api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp


def test_burst_is_served_whole_on_the_prefill_worker_with_identical_text(spine_cluster, disaggregated_api):  # noqa: F811
    reference = {p: complete(disaggregated_api, p) for p in WORDS}
    prefill_id = next(iter(reference.values())).headers["x-mooncake-prefill"]
    for r in reference.values():
        assert r.headers["x-mooncake-prefill"] != r.headers["x-mooncake-decode"]  # fixed roles: pushed
    with concurrent.futures.ThreadPoolExecutor(len(WORDS)) as ex:
        served = dict(zip(WORDS, ex.map(lambda p: complete(spine_cluster.api, p), WORDS)))
    whole_on_prefill = [p for p, r in served.items()
                        if r.headers["x-mooncake-prefill"] == r.headers["x-mooncake-decode"] == prefill_id]
    assert whole_on_prefill, {p[:12]: (r.headers["x-mooncake-prefill"], r.headers["x-mooncake-decode"])
                              for p, r in served.items()}
    for p, r in served.items():
        assert r.json()["choices"][0]["text"] == reference[p].json()["choices"][0]["text"]
