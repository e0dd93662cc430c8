"""`mooncake serve` restarts a worker that dies once the cluster is up, and the cluster uses it
again: the conductor routes to it, and KV is pushed into the new process (mooncake/supervisor.py).

It kills the decode worker of the shared cluster, so it waits until that worker is back and
serving disaggregated requests before it ends: tests after it find the cluster as it was."""

import signal
import time

import httpx
import psutil
import pytest

from mooncake.supervisor import group_running
from tests.conftest import MODEL_NAME
from tests.processes import wait_workers_seen, worker_process

pytestmark = pytest.mark.vllm


def _engine_core(processes: list[psutil.Process]) -> psutil.Process:
    cores = [p for p in processes if "EngineCore" in p.name() + " ".join(p.cmdline())]
    assert len(cores) == 1, [p.name() for p in processes]
    return cores[0]


@pytest.mark.parametrize("killed", ["worker", "engine"])
def test_a_killed_worker_is_restarted_its_engine_processes_reaped_and_served_again(spine_cluster, disaggregated_api,
                                                                                   killed):
    """`worker`: the worker's own process, as the OOM killer would take it (its engines stay).
    `engine`: only its vLLM engine core; the worker, alive but useless, must stop so that it is
    restarted (it used to stay up answering /health "failed", out of the cluster for good)."""
    decode_url = spine_cluster.worker_urls["decode"]
    victim = worker_process(spine_cluster.proc.process.pid, decode_url.rsplit(":", 1)[1])
    engines = victim.children(recursive=True)
    assert engines, "the decode worker runs no engine process: nothing to reap"
    (victim if killed == "worker" else _engine_core(engines)).send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while group_running(victim.pid) or any(e.is_running() and e.status() != psutil.STATUS_ZOMBIE for e in engines):
        assert time.monotonic() < deadline, "the dead worker's engine processes were left running"
        time.sleep(0.5)
    seen = set()
    deadline = time.monotonic() + 300
    while True:  # the conductor sees it down, then back
        health = httpx.get(spine_cluster.base_url + "/health", timeout=10).json()
        seen.add(health["status"])
        if "degraded" in seen and health["status"] == "ok":
            break
        assert time.monotonic() < deadline, f"the decode worker never came back: {health['workers']}"
        time.sleep(1)
    assert spine_cluster.proc.alive()
    assert "restarting it in" in spine_cluster.proc.log_tail(2000)
    if killed == "engine":
        assert "engine died; stopping the worker" in spine_cluster.proc.log_tail(4000)
        assert "(its vLLM engine died); restarting it in" in spine_cluster.proc.log_tail(4000)
    restarted = worker_process(spine_cluster.proc.process.pid, decode_url.rsplit(":", 1)[1])
    assert restarted.pid != victim.pid
    # The fixed-roles conductor pushes a prompt's KV into the new decode process.
    wait_workers_seen(disaggregated_api.removesuffix("/v1"))
    prompt = "After the restart, the capital of France is " + " ".join(f"fact-{i}" for i in range(200))
    resp = httpx.post(disaggregated_api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-mooncake-prefill"] != resp.headers["x-mooncake-decode"]
    assert int(resp.headers["x-mooncake-decode-cached-tokens"]) == resp.json()["usage"]["prompt_tokens"]
