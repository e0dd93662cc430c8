"""A worker that freezes mid-request (SIGSTOP: no crash, so no connection reset) ends its
request's stream with an error within the conductor's health window, not after token_timeout_s
(conductor/workers.py, WorkerHandle.abandon_silent_streams). Through both conductors of the
shared cluster: the fixed-roles one names its workers by URL; the main one follows the embedded
registry, where the frozen worker's lease runs out about when its streams are given up (the
registry's view drops it 2 x 5 s after its last heartbeat; WorkerPool.departed keeps it polled).

It freezes a worker of the shared cluster, so it thaws it and waits until both conductors route
to it again before it ends: tests after it find the cluster as it was."""

import time

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.processes import wait_workers_seen, worker_process

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("conductor", ["fixed_roles", "registry"])
def test_a_frozen_worker_ends_its_stream_with_an_error_not_a_hang(spine_cluster, disaggregated_api, conductor):
    api = disaggregated_api if conductor == "fixed_roles" else spine_cluster.base_url + "/v1"
    bases = (disaggregated_api.removesuffix("/v1"), spine_cluster.base_url)
    for base in bases:
        wait_workers_seen(base)
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)
    with client.completions.with_streaming_response.create(
            model=MODEL_NAME, prompt="Once upon a time, in a frozen land,", max_tokens=1500, temperature=0,
            stream=True, extra_body={"ignore_eos": True}) as raw:
        decoding = raw.headers["x-mooncake-decode"]  # the worker streaming the tokens
        workers = httpx.get(api.removesuffix("/v1") + "/health", timeout=10).json()["workers"]
        (url,) = [w["url"] for w in workers if decoding in (w["instance_id"], w["url"])]
        victim = worker_process(spine_cluster.proc.process.pid, url.rsplit(":", 1)[1])
        tokens = iter(raw.parse())
        # Past the prefill worker's first token: the decoding worker has sent tokens too. (Frozen
        # before its first, the request would be rerun on another worker, and end well.)
        for _ in range(3):
            assert next(tokens).choices[0].text is not None
        victim.suspend()
        frozen_at = time.monotonic()
        try:
            with pytest.raises(openai.APIError, match="stopped answering") as caught:
                for _ in tokens:
                    assert time.monotonic() - frozen_at < 120, "the stream outlived the frozen worker"
            waited = time.monotonic() - frozen_at
        finally:
            victim.resume()
    # Three health polls of up to 2 s, a second apart, then the next poll: about 9 s; the
    # conductor's token_timeout_s (120 s) is what a frozen worker's stream waited before.
    assert waited < 40, f"the stream ended {waited:.0f} s after the worker froze: {caught.value}"
    metrics = httpx.get(api.removesuffix("/v1") + "/metrics", timeout=10).text
    given_up = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("mooncake_worker_streams_given_up_total{") and f'"{decoding}"' in line]
    assert given_up and given_up[0] >= 1, "the conductor's metrics do not count the stream it gave up"
    for base in bases:
        wait_workers_seen(base)
    resp = client.completions.create(model=MODEL_NAME, prompt="After the thaw,", max_tokens=4, temperature=0)
    assert resp.choices[0].text
