"""Real engines report measured times, and the conductor calibrates each worker from them."""

import httpx
import pytest

from mooncake.protocol import CHUNK_DECODER, ENCODER, GenerateRequest, Sampling
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm


def test_final_chunk_carries_positive_measured_times(spine_cluster):
    request = GenerateRequest("calib-direct", list(range(1000, 1300)), Sampling(max_tokens=6, ignore_eos=True))
    with httpx.stream("POST", spine_cluster.worker_urls["decode"] + "/internal/generate",
                      content=ENCODER.encode(request), timeout=120, headers=spine_cluster.internal_headers) as resp:
        assert resp.status_code == 200
        chunks = [CHUNK_DECODER.decode(line) for line in resp.iter_lines() if line]
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.queued_s is not None and last.queued_s >= 0
    assert last.prefill_s is not None and last.prefill_s > 0
    assert last.decode_step_s is not None and last.decode_step_s > 0
    assert all(c.prefill_s is None for c in chunks[:-1])  # only the last line carries them


def test_debug_estimators_show_samples_for_both_workers(spine_cluster, disaggregated_api):
    # Through the fixed-roles conductor: the serve conductor's flexible roles may prefill all three
    # on the decode worker (it did, after earlier tests had restarted workers), leaving the prefill
    # worker without a sample.
    for i in range(3):  # long, distinct prompts: prefilled on the prefill worker, decoded on the other
        prompt = " ".join(f"w{i}x{j}" for j in range(700))
        resp = httpx.post(disaggregated_api + "/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "ignore_eos": True}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-mooncake-prefill"] != resp.headers["x-mooncake-decode"]
    base = disaggregated_api.removesuffix("/v1")
    body = httpx.get(base + "/internal/debug/estimators", timeout=10, headers=spine_cluster.internal_headers).json()
    instances = body["instances"]
    prefill = [name for name, fits in instances.items() if fits["prefill"]["samples"] > 0]
    decode = [name for name, fits in instances.items() if fits["decode_step"]["samples"] > 0]
    assert prefill and decode and set(prefill) | set(decode) == set(instances) and len(instances) == 2, body
    for fits in instances.values():
        for fit in fits.values():
            if fit["samples"]:
                assert 0.1 <= fit["scale"] <= 10 and fit["relative_error"] >= 0
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert "mooncake_estimator_prefill_scale{" in metrics and "mooncake_estimator_samples{" in metrics
