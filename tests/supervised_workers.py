"""Workers for the supervisor's tests: Python one-liners in their own process groups, as `serve`
starts its workers, killed with their groups when the test ends."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

# A worker that starts a child in its own process group (as vLLM's EngineCore is), then dies.
DIES_LEAVING_A_CHILD = ("import subprocess, sys, time; "
                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                        "time.sleep(0.3); sys.exit(3)")
LIVES = "import time; time.sleep(120)"


@dataclass
class Worker:
    role: str
    url: str
    process: subprocess.Popen
    code: str


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def spawn(worker: Worker) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", worker.code], start_new_session=True)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_exit(proc: subprocess.Popen) -> None:
    proc.wait(timeout=30)
