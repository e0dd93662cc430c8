"""Starting and stopping the real processes the end-to-end tests talk to."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from mooncake.net import free_port, free_port_block

ROOT = Path(__file__).resolve().parents[1]
# The KV cache of each vLLM engine the tests start (GiB; 23k tokens of the default model): CI
# holds up to six engines at once on 24 GiB, and vLLM touches all of its KV cache at start.
KV_CACHE_GIB = "0.5"


@dataclass
class Proc:
    name: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.process.pid, sig)
            self.process.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def closed_by_server(sock: socket.socket, within_s: float = 5.0) -> bytes:
    """What the server sent before it closed the connection (raises if it stays open)."""
    sock.settimeout(within_s)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def start(name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=full_env, start_new_session=True)
    return Proc(name, proc, log_path)


def wait_http(proc: Proc, url: str, timeout_s: float, want: int = 200) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.process.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(url, timeout=2.0).status_code == want:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{proc.name} not ready at {url} after {timeout_s:.0f} s:\n{proc.log_tail()}")


def worker_process(serve_pid: int, port: str) -> psutil.Process:
    """The worker process that `mooncake serve` (pid `serve_pid`) started on `port`."""
    for child in psutil.Process(serve_pid).children():
        args = child.cmdline()
        if any(a == "--port" and b == port for a, b in zip(args, args[1:])):
            return child
    raise AssertionError(f"no worker process on port {port} under serve (pid {serve_pid})")


def wait_workers_seen(base: str, timeout_s: float = 120, role: str | None = None) -> None:
    """Until the conductor at `base` has seen a ready worker in each role (or in `role` only)."""
    deadline = time.monotonic() + timeout_s  # generous: a loaded machine polls slowly
    while True:
        ready = httpx.get(base + "/health", timeout=10).json()["ready"]
        if min(ready.values() if role is None else [ready[role]]) >= 1:
            return
        assert time.monotonic() < deadline, f"the conductor at {base} never saw its workers ready: {ready}"
        time.sleep(0.5)
