"""A worker that freezes mid-request (SIGSTOP: no crash, so no connection reset) ends its
request's stream with an error within the conductor's health window, not after token_timeout_s
(conductor/workers.py, WorkerHandle.abandon_silent_streams).

It freezes the decode worker of the shared cluster, so it thaws it and waits until both
conductors route to it again before it ends: tests after it find the cluster as it was."""

import time

import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.processes import wait_workers_seen, worker_process

pytestmark = pytest.mark.vllm


def test_a_frozen_decode_worker_ends_its_stream_with_an_error_not_a_hang(spine_cluster, disaggregated_api):
    decode_port = spine_cluster.worker_urls["decode"].rsplit(":", 1)[1]
    victim = worker_process(spine_cluster.proc.process.pid, decode_port)
    wait_workers_seen(disaggregated_api.removesuffix("/v1"))
    client = openai.OpenAI(base_url=disaggregated_api, api_key="unused", max_retries=0, timeout=300)
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time, in a frozen land,",
                                       max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    tokens = iter(stream)
    assert next(tokens).choices[0].text is not None  # the decode worker is streaming
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
    for base in (disaggregated_api.removesuffix("/v1"), spine_cluster.base_url):
        wait_workers_seen(base)
    resp = client.completions.create(model=MODEL_NAME, prompt="After the thaw,", max_tokens=4, temperature=0)
    assert resp.choices[0].text
