"""Starting the systems a benchmark compares, on this machine, on free ports."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from mooncake.net import free_port, free_port_block

# serve's workers listen on consecutive ports from --worker-port: a block this long is checked
# free (1P+1D and what `extra` adds; a lone free port's neighbour was once taken).
WORKER_PORTS = 8

MODEL_NAME = "SmolLM2-135M-Instruct"


@contextmanager
def running(name: str, args: list[str], health_url: str, log_dir: Path, env: dict | None = None,
            timeout_s: float = 400, python: str | Path = sys.executable, cwd: Path | None = None):
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{name}.log", "wb")
    proc = subprocess.Popen([str(python), *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True, cwd=cwd)
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
    port, worker_port = free_port(), free_port_block(WORKER_PORTS)
    args = ["-m", "mooncake.cli", "serve", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--worker-port", str(worker_port), "--dtype", dtype, *extra]
    with running("mooncake", args, f"http://127.0.0.1:{port}/health", log_dir):
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def colocated_vllm(model: str, log_dir: Path, dtype: str = "float32", cores: str | None = None):
    port = free_port()
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", MODEL_NAME,
            "--port", str(port), "--dtype", dtype, "--max-model-len", "8192", "--enforce-eager",
            "--max-num-batched-tokens", "2048"]
    # Every core this process may use, bound explicitly: the peer gets the same cores we do
    # (or `cores`, a VLLM_CPU_OMP_THREADS_BIND value, when a benchmark gives it fewer).
    if cores is None:
        mine = sorted(os.sched_getaffinity(0))
        cores = f"{mine[0]}-{mine[-1]}"
    with running("colocated-vllm", args, f"http://127.0.0.1:{port}/health", log_dir,
                 env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores}):
        yield f"http://127.0.0.1:{port}/v1"


def port_outside_ephemeral_range(low: int = 20000, high: int = 32000) -> int:
    """A free port the OS never hands out on its own (Linux's ephemeral range is 32768-60999).

    P's bootstrap server binds its port late, when the engine registers its KV caches; a port
    from free_port() had by then been taken by one of vLLM's own sockets (seen: "Address
    already in use" on 0.0.0.0 and the prefill server exiting).
    """
    for port in random.sample(range(low, high), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")


@contextmanager
def vllm_mooncake_pd(model: str, log_dir: Path, dtype: str = "float32"):
    """vLLM with its own MooncakeConnector, 1 prefill + 1 decode (TCP transfer engine), behind
    benchmarks/peers/pd_proxy.py; yields the proxy's /v1 URL. Each engine is pinned to one core.

    The servers run from the peer venv (benchmarks/peers/venv.py), with cwd = log_dir and no
    PYTHONPATH, so `mooncake` is the transfer engine and never this repository's package.
    """
    from benchmarks.peers.venv import SHIM_ENV, ensure_peer_venv

    python = ensure_peer_venv()
    log_dir = Path(log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    bootstrap_port = port_outside_ephemeral_range()
    engine_id = f"peer-prefill-{uuid.uuid4().hex[:8]}"
    base_env = {SHIM_ENV: "1", "PYTHONPATH": "", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap_port)}

    def server(port: int, role: str, core: str):
        kv = {"kv_connector": "MooncakeConnector", "kv_role": role,
              "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        if role == "kv_producer":
            kv["engine_id"] = engine_id  # the proxy names it in each hand-over
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--served-model-name", MODEL_NAME, "--port", str(port), "--dtype", dtype,
                "--max-model-len", "8192", "--enforce-eager", "--max-num-batched-tokens", "2048",
                "--kv-transfer-config", json.dumps(kv)]
        name = "peer-prefill" if role == "kv_producer" else "peer-decode"
        return running(name, args, f"http://127.0.0.1:{port}/health", log_dir,
                       env={**base_env, "VLLM_CPU_OMP_THREADS_BIND": core}, python=python,
                       cwd=log_dir)

    proxy_args = ["-m", "benchmarks.peers.pd_proxy", "--port", str(proxy_port),
                  "--prefill-url", f"http://127.0.0.1:{p_port}",
                  "--decode-url", f"http://127.0.0.1:{d_port}",
                  "--prefill-engine-id", engine_id,
                  "--bootstrap-addr", f"http://127.0.0.1:{bootstrap_port}"]
    with ExitStack() as stack:
        # One at a time: two engines starting together on 2 cores only slow each other.
        stack.enter_context(server(p_port, "kv_producer", "0"))
        stack.enter_context(server(d_port, "kv_consumer", "1"))
        stack.enter_context(running("peer-proxy", proxy_args,
                                    f"http://127.0.0.1:{proxy_port}/health", log_dir,
                                    cwd=Path(__file__).resolve().parents[1], timeout_s=60))
        yield f"http://127.0.0.1:{proxy_port}/v1"
