"""`mooncake serve`: the embedded single-machine cluster.

Starts N prefill and M decode worker processes (each its own process group, so stopping them
also stops vLLM's engine processes), then runs the conductor in this process. Ctrl-C or SIGTERM
stops the conductor, then every worker it started.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from conductor.core.config import SchedulerConfig
from mooncake.logs import uvicorn_log_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    first_worker_port: int = 8100
    dtype: str = "float32"
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    chunk_size: int = 2048
    api_key: str | None = None
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(
        block_size=128, ttft_slo_s=30.0, tbt_slo_s=0.5, default_decode_s=5.0))
    profile: str = "smollm2-135m-cpu"

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker (and zero or more prefill workers)")


def plan_cpu_binding(cores: list[int], count: int) -> list[str]:
    """Give each of `count` workers its own contiguous slice of `cores` (a shared core when there
    are fewer cores than workers), so engines do not oversubscribe each other's threads."""
    if count <= 0:
        return []
    cores = sorted(cores)
    if len(cores) < count:
        return [str(cores[i % len(cores)]) for i in range(count)]
    per, extra = divmod(len(cores), count)
    plan, start = [], 0
    for i in range(count):
        size = per + (1 if i < extra else 0)
        chunk = cores[start:start + size]
        plan.append(str(chunk[0]) if size == 1 else f"{chunk[0]}-{chunk[-1]}")
        start += size
    return plan


@dataclass
class WorkerProcess:
    role: str
    url: str
    process: subprocess.Popen


class Cluster:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.workers: list[WorkerProcess] = []

    def start(self) -> None:
        c = self.config
        roles = ["prefill"] * c.num_prefill + ["decode"] * c.num_decode
        binding = plan_cpu_binding(list(os.sched_getaffinity(0)), len(roles))
        for i, (role, cores) in enumerate(zip(roles, binding)):
            port = c.first_worker_port + i
            cmd = [sys.executable, "-m", "mooncake.cli", role, "--model", c.model_path,
                   "--served-model-name", c.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", c.dtype, "--max-model-len", str(c.max_model_len),
                   "--kv-cache-gib", f"{c.kv_cache_gib:g}", "--chunk-size", str(c.chunk_size),
                   "--cpu-bind", cores, "--instance-id", f"{role}-{i}",
                   "--block-size", str(c.scheduler.block_size),
                   # The conductor in this process hosts the embedded registry.
                   "--registry", f"embedded+http://127.0.0.1:{c.port}"]
            proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
            self.workers.append(WorkerProcess(role, f"http://127.0.0.1:{port}", proc))
            log.info("started %s worker on port %d (cores %s, pid %d)", role, port, cores, proc.pid)

    def urls(self, role: str) -> tuple[str, ...]:
        return tuple(w.url for w in self.workers if w.role == role)

    def stop(self, grace_s: float = 10.0) -> None:
        for w in self.workers:
            _signal_group(w.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            try:
                w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # vLLM's engine processes live in the same group; make sure none outlives us.
            _signal_group(w.process, signal.SIGKILL)
        self.workers.clear()


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the launcher dies, even by SIGKILL, so no worker is orphaned."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _exit_on_sigterm(signum, frame) -> None:
    # uvicorn re-raises the SIGTERM it caught once it has shut down; the default action would
    # kill this process before `finally` stops the workers. Raising here runs the cleanup.
    raise SystemExit(128 + signum)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def serve(config: ClusterConfig) -> int:
    import uvicorn

    from conductor.app import create_app
    from conductor.config import ConductorConfig

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    cluster = Cluster(config)
    cluster.start()
    try:
        app = create_app(ConductorConfig(
            model_path=config.model_path, served_model_name=config.served_model_name, host=config.host,
            port=config.port, prefill_urls=cluster.urls("prefill"), decode_urls=cluster.urls("decode"),
            max_model_len=config.max_model_len, api_key=config.api_key, scheduler=config.scheduler,
            profile=config.profile,
        ))
        log.info("conductor on http://%s:%d/v1 (workers take ~30-60 s to load; /health says when ready)",
                 config.host, config.port)
        uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5,
                    log_config=uvicorn_log_config())
    finally:
        log.info("stopping workers")
        cluster.stop()
    return 0
