"""`mooncake serve` ends with a worker's error when that worker dies while starting.

The workers here are fake processes (a Python one-liner), so no engine starts; what is tested
is the launcher's watch (wait_until_ready) and its verdict on each worker (startup_failure).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from mooncake.defaults import WorkerRole
from mooncake.launcher import WorkerProcess, startup_failure, wait_until_ready


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def run(code: str, role: WorkerRole = WorkerRole.DECODE, url: str = "http://127.0.0.1:1") -> WorkerProcess:
        proc = subprocess.Popen([sys.executable, "-c", code])
        procs.append(proc)
        return WorkerProcess(role, url, proc)

    yield run
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_worker_that_exits_while_starting_ends_the_wait_with_its_exit_code(spawn):
    alive = spawn("import time; time.sleep(60)", WorkerRole.PREFILL, "http://127.0.0.1:1")
    dead = spawn("import sys; sys.exit(3)", WorkerRole.DECODE, "http://127.0.0.1:2")
    dead.process.wait(timeout=30)
    error = wait_until_ready([alive, dead], lambda url: None, threading.Event(), interval_s=0.01)
    assert error and "decode worker http://127.0.0.1:2" in error and "exited with code 3" in error


def test_a_worker_whose_health_says_failed_ends_the_wait_with_its_error(spawn):
    worker = spawn("import time; time.sleep(60)")
    bodies = iter([None, {"status": "starting"}, {"status": "failed", "error": "RuntimeError: no KV room"}])
    error = wait_until_ready([worker], lambda url: next(bodies), threading.Event(), interval_s=0.01)
    assert error and "failed to start: RuntimeError: no KV room" in error


def test_the_wait_ends_quietly_once_every_worker_is_ready(spawn):
    workers = [spawn("import time; time.sleep(60)", url=f"http://127.0.0.1:{i}") for i in (1, 2)]
    polls: dict[str, int] = {}

    def health(url: str) -> dict:
        polls[url] = polls.get(url, 0) + 1
        return {"status": "ready" if polls[url] >= 2 else "starting"}

    assert wait_until_ready(workers, health, threading.Event(), interval_s=0.01) is None
    # A ready worker is no longer polled: each answered "starting" once, then "ready" once.
    assert polls == {"http://127.0.0.1:1": 2, "http://127.0.0.1:2": 2}


def test_the_wait_stops_when_serve_stops(spawn):
    worker = spawn("import time; time.sleep(60)")
    stop = threading.Event()
    stop.set()
    assert wait_until_ready([worker], lambda url: {"status": "starting"}, stop, interval_s=0.01) is None


def test_a_ready_or_starting_worker_is_no_failure(spawn):
    worker = spawn("import time; time.sleep(60)")
    assert startup_failure(worker, None) is None
    assert startup_failure(worker, {"status": "starting"}) is None
    assert startup_failure(worker, {"status": "ready"}) is None
