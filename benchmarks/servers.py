"""Starting the systems a benchmark compares, on this machine, on free ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from mooncake.net import free_port

MODEL_NAME = "SmolLM2-135M-Instruct"


@contextmanager
def running(name: str, args: list[str], health_url: str, log_dir: Path, env: dict | None = None,
            timeout_s: float = 400):
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited early; see {log_dir / (name + '.log')}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s} s")
            time.sleep(1)
        print(f"[{name}] ready", file=sys.stderr)
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        log.close()


@contextmanager
def mooncake_cluster(model: str, log_dir: Path, extra: list[str] = (), dtype: str = "float32"):
    port, worker_port = free_port(), free_port()
    args = ["-m", "mooncake.cli", "serve", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--worker-port", str(worker_port), "--dtype", dtype, *extra]
    with running("mooncake", args, f"http://127.0.0.1:{port}/health", log_dir):
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def colocated_vllm(model: str, log_dir: Path, dtype: str = "float32"):
    port = free_port()
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--dtype", dtype, "--max-model-len", "8192", "--enforce-eager",
            "--max-num-batched-tokens", "2048"]
    # Every core this process may use, bound explicitly: the peer gets the same cores we do.
    cores = sorted(os.sched_getaffinity(0))
    with running("colocated-vllm", args, f"http://127.0.0.1:{port}/health", log_dir,
                 env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}):
        yield f"http://127.0.0.1:{port}/v1"
