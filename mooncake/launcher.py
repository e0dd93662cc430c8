"""`mooncake serve`: the embedded single-machine cluster.

Starts N prefill and M decode worker processes (each its own process group, so stopping them
also stops vLLM's engine processes), then runs the conductor in this process. Ctrl-C or SIGTERM
stops the conductor, then every worker it started. A worker that dies while starting (its
process exits, or its /health says "failed") ends `serve` with that worker's error: no cluster
that can never become ready keeps answering 503. Once every worker is up, one that dies is
restarted (mooncake/supervisor.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conductor.config import live_scheduler_config
from conductor.core.config import SchedulerConfig
from conductor.slo import SLOBounds
from mooncake import defaults
from mooncake.auth import TOKEN_ENV, generate_token
from mooncake.defaults import Dtype, WorkerRole, chunk_size_error, engine_option_errors
from mooncake.logs import uvicorn_log_config
from mooncake.net import http_server_config, url_host
from mooncake.supervisor import RestartPolicy, Supervisor, exit_reason, group_running, kill_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    model_path: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = defaults.CONDUCTOR_PORT
    num_prefill: int = 1
    num_decode: int = 1
    first_worker_port: int = defaults.PREFILL_PORT
    dtype: Dtype = defaults.DTYPE
    max_model_len: int = defaults.MAX_MODEL_LEN
    kv_cache_gib: float = defaults.KV_CACHE_GIB
    chunk_size: int = defaults.CHUNK_SIZE
    """The prefill workers' tokens per engine step."""
    decode_chunk_size: int | None = defaults.DECODE_CHUNK_SIZE  # None: chunk_size
    """The decode workers' (defaults.DECODE_CHUNK_SIZE says why it is smaller)."""
    api_keys: tuple = field(default=(), repr=False)
    """conductor.auth.ApiKey entries of the public API (none: open)."""
    cluster_token: str | None = field(default=None, repr=False)
    """The internal endpoints' secret; None: serve generates one and hands it to its workers."""
    scheduler: SchedulerConfig = field(default_factory=live_scheduler_config)
    """Its block_size is also every worker's, so they cannot disagree."""
    profile: str | None = None
    """None: the bundled table measured in `dtype` (conductor.config.resolve_profile)."""
    slo_bounds: SLOBounds = field(default_factory=SLOBounds)
    """What a request may set itself (priority, own SLOs): the conductor's (conductor/slo.py)."""
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    """How workers that die once the cluster is up are restarted (mooncake/supervisor.py)."""
    pool_args: tuple[str, ...] = ()
    """Each worker's KVCache pool options (mooncake.engine.cli.pool_arguments; none: the defaults,
    a pool on). A --pool-ssd-dir becomes one subdirectory per worker, each told how many share its disk."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker (and zero or more prefill workers)")
        # Checked here, before any worker starts: each would otherwise die inside vLLM.
        errors = engine_option_errors(self.kv_cache_gib, self.scheduler.block_size, self.chunk_size)
        if self.decode_chunk_size is not None and (
                error := chunk_size_error(self.decode_chunk_size, "--decode-chunk-size")) is not None:
            errors.append(error)
        if errors:
            raise ValueError("; ".join(errors))


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
        plan.append(core_list(cores[start:start + size]))
        start += size
    return plan


def core_list(cores: list[int]) -> str:
    """vLLM's (and taskset's) core list: ids, with runs of consecutive ids as ranges ("0-1,8-9").
    A range over a gap would take cores this process may not use (a cpuset with holes)."""
    parts: list[str] = []
    first = prev = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == prev + 1:
            prev = core
            continue
        parts.append(str(first) if first == prev else f"{first}-{prev}")
        if core is not None:
            first = prev = core
    return ",".join(parts)


@dataclass
class WorkerProcess:
    role: WorkerRole
    url: str
    process: subprocess.Popen
    command: tuple[str, ...] = ()  # how it was started, to start it again


def startup_failure(worker: WorkerProcess, health: dict | None) -> str | None:
    """The error that ends `serve` for this starting worker, or None (pure but for poll()).

    `health` is the body of its /health (None: not answering yet)."""
    code = worker.process.poll()
    if code is not None:
        return (f"{worker.role} worker {worker.url} (pid {worker.process.pid}) {exit_reason(code)} "
                f"while starting; its log is above")
    if health and health.get("status") == "failed":
        return f"{worker.role} worker {worker.url} failed to start: {health.get('error') or 'no error given'}"
    return None


def wait_until_ready(workers: list[WorkerProcess], fetch_health: Callable[[str], dict | None],
                     stop: threading.Event, interval_s: float = 1.0) -> str | None:
    """Watch starting workers until all are ready (None), one fails (its error), or `stop` is
    set (None). A ready worker is no longer watched here: later deaths are the supervisor's."""
    starting = list(workers)
    while starting and not stop.is_set():
        still = []
        for w in starting:
            health = fetch_health(w.url)
            failure = startup_failure(w, health)
            if failure:
                return failure
            if not (health and health.get("status") == "ready"):
                still.append(w)
        starting = still
        if starting:
            stop.wait(interval_s)
    return None


def fetch_health(url: str) -> dict | None:
    import httpx

    try:
        body = httpx.get(f"{url}/health", timeout=2.0).json()
    except (httpx.HTTPError, ValueError):
        return None
    return body if isinstance(body, dict) else None


class Cluster:
    def __init__(self, config: ClusterConfig, cluster_token: str):
        self.config = config
        self.cluster_token = cluster_token
        self.workers: list[WorkerProcess] = []

    def start(self) -> None:
        c = self.config
        roles = [WorkerRole.PREFILL] * c.num_prefill + [WorkerRole.DECODE] * c.num_decode
        binding = plan_cpu_binding(list(os.sched_getaffinity(0)), len(roles))
        # The conductor in this process hosts the embedded registry, where it listens: loopback
        # unless --host names one address (then only that one).
        registry_host = "127.0.0.1" if c.host in ("0.0.0.0", "::", "", "localhost") else c.host
        registry = f"embedded+http://{url_host(registry_host)}:{c.port}"
        for i, (role, cores) in enumerate(zip(roles, binding)):
            port = c.first_worker_port + i
            # Decode workers prefill only beside a batch (unless no prefill worker exists).
            chunk = c.decode_chunk_size or c.chunk_size if role == WorkerRole.DECODE and c.num_prefill else c.chunk_size
            cmd = [sys.executable, "-m", "mooncake.cli", role, "--model", c.model_path,
                   "--served-model-name", c.served_model_name, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", str(c.dtype), "--max-model-len", str(c.max_model_len),
                   "--kv-cache-gib", f"{c.kv_cache_gib:g}",
                   "--chunk-size", str(chunk),
                   "--cpu-bind", cores, "--instance-id", f"{role}-{i}",
                   "--block-size", str(c.scheduler.block_size),
                   "--registry", registry, *worker_pool_args(c.pool_args, f"{role}-{i}", len(roles))]
            worker = WorkerProcess(role, f"http://127.0.0.1:{port}", None, tuple(cmd))
            worker.process = self.spawn(worker)
            self.workers.append(worker)
            log.info("started %s worker on port %d (cores %s, pid %d)", role, port, cores, worker.process.pid)

    def spawn(self, worker: WorkerProcess) -> subprocess.Popen:
        # The token goes by the environment, never the command line (which `ps` shows).
        return subprocess.Popen(worker.command, start_new_session=True, preexec_fn=_die_with_parent,
                                env={**os.environ, TOKEN_ENV: self.cluster_token})

    def urls(self, role: WorkerRole) -> tuple[str, ...]:
        return tuple(w.url for w in self.workers if w.role == role)

    def stop(self, grace_s: float = 10.0) -> None:
        try:
            for w in self.workers:
                kill_group(w.process, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for w in self.workers:
                try:
                    w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                # vLLM's engine processes live in the same group, and got the SIGTERM too: the rest
                # of the grace lets them shut down, which removes their shared memory (a
                # /dev/shm/psm_* file of 160 MiB, sparse, was left behind at each stop when they
                # were killed at once).
                while group_running(w.process.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            # Whatever happened meanwhile (a second Ctrl-C while a worker still loads and ignores
            # SIGTERM), none outlives us.
            for w in self.workers:
                kill_group(w.process)
            self.workers.clear()


def worker_pool_args(pool_args: tuple[str, ...], instance: str, workers: int = 1) -> list[str]:
    """The pool options of one of `workers` workers: each keeps its SSD tier in its own
    subdirectory (two pools must never share block files). Those subdirectories share one disk,
    whose free space each pool sees whole at start: each is told how many share it, and takes
    its share (store/ssd.py, SsdTier.room_for_files)."""
    args = list(pool_args)
    if "--pool-ssd-dir" in args:
        i = args.index("--pool-ssd-dir") + 1
        args[i] = os.path.join(args[i], instance)
        if workers > 1:
            args += ["--pool-ssd-shared-by", str(workers)]
    return args


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


def serve(config: ClusterConfig) -> int:
    """Run the cluster until Ctrl-C / SIGTERM (0) or until a worker dies while starting (1)."""
    from conductor.app import close_streams, create_app
    from conductor.config import ConductorConfig
    from mooncake.drain import DrainingServer

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    cluster = Cluster(config, config.cluster_token or generate_token())
    cluster.start()
    stop = threading.Event()
    failure: list[str] = []
    watcher: threading.Thread | None = None
    try:
        app = create_app(ConductorConfig(
            model_path=config.model_path, served_model_name=config.served_model_name, host=config.host,
            port=config.port, prefill_urls=cluster.urls(WorkerRole.PREFILL),
            decode_urls=cluster.urls(WorkerRole.DECODE), max_model_len=config.max_model_len,
            api_keys=config.api_keys, cluster_token=cluster.cluster_token, scheduler=config.scheduler,
            profile=config.profile, dtype=config.dtype, slo_bounds=config.slo_bounds,
        ))
        # Ctrl-C or SIGTERM: answers in progress end at their next token with an error event
        # (close_streams), and uvicorn cuts what is left (a request before its first token) after 5 s.
        server = DrainingServer(http_server_config(app, config.host, config.port, log_level="info",
                                                   timeout_graceful_shutdown=5, log_config=uvicorn_log_config()),
                                drain=None, on_exit=lambda: close_streams(app))

        def watch() -> None:
            error = wait_until_ready(cluster.workers, fetch_health, stop)
            if error:
                failure.append(error)
                server.should_exit = True  # uvicorn polls this and shuts down; `finally` stops the rest
                return
            supervisor = Supervisor(cluster.workers, cluster.spawn, config.restart_policy, time.monotonic,
                                    probe=fetch_health, halted=stop.is_set)
            while not stop.wait(1.0):
                supervisor.check()

        watcher = threading.Thread(target=watch, name="worker-watch", daemon=True)
        watcher.start()
        log.info("conductor on http://%s:%d/v1 (workers take ~30-60 s to load; /health says when ready)",
                 config.host, config.port)
        server.run()
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=10)  # a restart under way ends before the workers are stopped
        log.info("stopping workers")
        cluster.stop()
    if failure:
        print(f"mooncake serve: {failure[0]}; stopped the other workers", file=sys.stderr)
        return 1
    return 0
