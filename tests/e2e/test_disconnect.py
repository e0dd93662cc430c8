"""A client that leaves, at any point, costs the cluster nothing afterwards: the conductor's
in-flight slots, ledgers and pending prefixes empty, and both workers stop running the request."""

import time

import httpx
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm

LONG = {"model": MODEL_NAME, "prompt": "Count slowly from one to one thousand:", "max_tokens": 200,
        "ignore_eos": True, "temperature": 0, "stream": True}


def held(cluster) -> dict:
    """What requests still hold: conductor slots, ledger entries, pending prefixes, worker requests."""
    requests = httpx.get(cluster.base_url + "/health", timeout=10).json()["requests"]
    workers = {role: httpx.get(url + "/internal/load", timeout=10, headers=cluster.internal_headers).json()["running_requests"]
               for role, url in cluster.worker_urls.items()}
    return {"in_flight": requests["in_flight"], "pending": requests["pending_prefix_entries"],
            "ledger_entries": sum(n for ledger in requests["ledgers"].values() for n in ledger.values()),
            "worker_requests": workers}


def assert_released(cluster, within_s: float = 20.0) -> None:
    idle = {"in_flight": 0, "pending": 0, "ledger_entries": 0, "worker_requests": {"prefill": 0, "decode": 0}}
    deadline = time.monotonic() + within_s
    while (now := held(cluster)) != idle and time.monotonic() < deadline:
        time.sleep(0.25)
    assert now == idle, now


def test_disconnect_before_the_first_byte(spine_cluster):
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", spine_cluster.api + "/completions", json=LONG) as resp:
            assert resp.status_code == 200
            # leave without reading a byte of the body
    assert_released(spine_cluster)


def test_disconnect_of_a_stream_before_its_first_token_stops_the_prefill(spine_cluster):
    """A stream is no response until its first token: the client leaving during a long prefill
    must cancel it then, not when the prefill (seconds here) and its KV hand-over are done."""
    body = {**LONG, "prompt": "Read this and then count: " + "one two three four five six seven eight " * 500}
    with httpx.Client(timeout=60) as client:
        with pytest.raises(httpx.ReadTimeout):
            with client.stream("POST", spine_cluster.api + "/completions", json=body,
                               timeout=httpx.Timeout(60, read=0.5)) as resp:
                resp.read()
    left = time.monotonic()
    assert_released(spine_cluster, within_s=20)
    # A 4,000-token prefill takes longer than this on the test machine's one core per worker.
    assert time.monotonic() - left < 4.0, "the prefill ran on after its client left"


def test_disconnect_after_the_first_token(spine_cluster):
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", spine_cluster.api + "/completions", json=LONG) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and '"text": ""' not in line:
                    break  # the first token's chunk
    assert_released(spine_cluster)


def test_disconnect_mid_stream_of_a_long_generation(spine_cluster):
    chunks = 0
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", spine_cluster.api + "/completions", json=LONG) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 40:
                    break
    assert chunks >= 40
    assert_released(spine_cluster)
    text = httpx.get(spine_cluster.base_url + "/metrics").text
    # counted as a client gone
    assert 'mooncake_requests_total{endpoint="completions",slo_class="default",status="499"}' in text


def test_non_streamed_request_whose_client_times_out(spine_cluster):
    # 2,000 tokens take minutes to generate here; the conductor must cancel the work when the
    # client leaves (uvicorn does not cancel the handler by itself), so it is freed in seconds.
    body = {**LONG, "stream": False, "max_tokens": 2000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(spine_cluster.api + "/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    assert_released(spine_cluster, within_s=30)


def test_the_cluster_still_answers_after_the_disconnects(spine_cluster):
    resp = httpx.post(spine_cluster.api + "/completions", timeout=120, json={
        "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200 and "Paris" in resp.json()["choices"][0]["text"]
    assert_released(spine_cluster)
