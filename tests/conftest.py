"""Shared fixtures. The expensive ones (real vLLM engines) are session-scoped: one embedded
cluster serves every end-to-end test that can share it."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import settings

# Property tests check properties, not speed: hypothesis' default 200 ms deadline per example
# fails them on a loaded 2-core machine (a wall-clock margin). Speed is measured in benchmarks/.
settings.register_profile("mooncake", deadline=None)
settings.load_profile("mooncake")

from mooncake import defaults
from tests.processes import KV_CACHE_GIB, Proc, free_port, free_port_block, start, wait_http, wait_workers_seen

# CI runs up to six vLLM workers at once on 24 GiB (about 3 GiB each); every worker's KVCache pool maps its DRAM
# tier (shared memory) as the tests compute blocks, so the processes the tests start get a small
# one (children inherit the environment; a test that needs another size passes --pool-dram-gib).
os.environ.setdefault("MOONCAKE_POOL_DRAM_GIB", "0.0625")
# glibc otherwise raises its mmap threshold as torch frees large buffers, and the engines' heaps
# then grow by hundreds of MB over a session (measured: a worker's heap 750 MB against 172 MB with
# it fixed). Memory for CI's sake only: the product leaves the allocator as vLLM has it.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")

MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def model_path() -> str:
    from mooncake.model import ensure_model

    return str(ensure_model())


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@dataclass
class Cluster:
    base_url: str
    worker_urls: dict[str, str]
    proc: Proc
    early: dict = field(default_factory=dict)  # what the conductor answered before workers were ready
    token_file: str = ""  # the cluster token: internal endpoints refuse calls without it

    @property
    def internal_headers(self) -> dict[str, str]:
        return {"X-Mooncake-Cluster-Token": Path(self.token_file).read_text().strip()}

    @property
    def api(self) -> str:
        return self.base_url + "/v1"


@pytest.fixture(scope="session")
def spine_cluster(model_path, log_dir) -> Cluster:
    """`mooncake serve` exactly as the README runs it: conductor + 1 prefill + 1 decode."""
    port, worker_port = free_port(), free_port_block(2)
    token_file = log_dir / "cluster-token"
    token_file.write_text(secrets.token_urlsafe(32))
    proc = start("serve", ["-m", "mooncake.cli", "serve", "--port", str(port), "--worker-port", str(worker_port),
                           "--kv-cache-gib", KV_CACHE_GIB, "--cluster-token-file", str(token_file)], log_dir)
    base = f"http://127.0.0.1:{port}"
    cluster = Cluster(base, {"prefill": f"http://127.0.0.1:{worker_port}",
                             "decode": f"http://127.0.0.1:{worker_port + 1}"}, proc, token_file=str(token_file))
    try:
        wait_http(proc, base + "/health", 120, want=503)  # conductor up, engines still loading
        resp = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10)
        cluster.early = {"status": resp.status_code, "body": resp.json(), "headers": dict(resp.headers)}
        wait_http(proc, base + "/health", 300)
        for url in cluster.worker_urls.values():  # the conductor answers 200 once one worker is up
            wait_http(proc, url + "/health", 300)
    except BaseException:
        proc.stop()
        raise
    yield cluster
    proc.stop(grace_s=30)
    assert not proc.alive()


@pytest.fixture(scope="session")
def colocated_server(model_path, log_dir):
    """Stock vLLM OpenAI server (no connector, no disaggregation), same engine settings."""
    port = free_port()
    proc = start("colocated", ["-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                               "--served-model-name", MODEL_NAME, "--port", str(port), "--dtype", str(defaults.DTYPE),
                               "--max-model-len", str(defaults.MAX_MODEL_LEN), "--enforce-eager",
                               "--max-num-batched-tokens", str(defaults.CHUNK_SIZE),
                               "--block-size", str(defaults.KV_BLOCK_SIZE),
                               "--kv-cache-memory-bytes", str(int(float(KV_CACHE_GIB) * 2**30))],
                 log_dir)
    try:
        wait_http(proc, f"http://127.0.0.1:{port}/health", 300)
    except BaseException:
        proc.stop()
        raise
    yield f"http://127.0.0.1:{port}/v1"
    proc.stop()


@pytest.fixture(scope="session")
def disaggregated_api(spine_cluster, model_path, log_dir):
    """A second conductor in front of the spine workers that always prefills on the prefill worker
    and decodes on the decode worker (fixed roles, never colocated): for tests that need the KV
    pushed. Shared by the session, like the cluster. It also has an SLO class less important than
    `default` (batch), which leaves default requests as they are (tests/e2e/test_priority.py).
    Its TTFT SLOs are wide (300 s default, 600 s batch, whose limit is then 0.8 x 300 s: a class
    is capped below the more important ones', conductor/core/admission.py limits_for): its tests
    are about the KV path, and admission must not depend on what the calibration learnt from the
    tests before them."""
    port = free_port()
    proc = start("conductor-always-disaggregated",
                 ["-m", "mooncake.cli", "conductor", "--port", str(port), "--model", model_path,
                  "--served-model-name", MODEL_NAME, "--no-conditional-disaggregation", "--no-flexible-roles",
                  "--ttft-slo", "300", "--slo-class", "batch:600000:2000:5",
                  "--cluster-token-file", spine_cluster.token_file,
                  "--prefill-url", spine_cluster.worker_urls["prefill"],
                  "--decode-url", spine_cluster.worker_urls["decode"]], log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(proc, base + "/health", 120)
        wait_workers_seen(base)
    except BaseException:
        proc.stop()
        raise
    yield base + "/v1"
    proc.stop()
