"""A throwaway single-node etcd for tests: temp data dir, free loopback ports.

Usable from any test package (load it by path, see tests/registry/conftest.py). It can be
killed (SIGKILL, like a crash) and restarted on the same ports and data dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from mooncake.net import free_port

MISSING = ("etcd binary not found on PATH or at /usr/bin/etcd. `make test` installs it "
           "(Debian: apt-get install -y etcd-server etcd-client); see docs/REGISTRY.md.")


def find_etcd() -> str:
    """Path of the etcd binary, or RuntimeError(MISSING)."""
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK)
                                    else None)
    if path is None:
        raise RuntimeError(MISSING)
    return path


class EtcdServer:
    """One etcd member on 127.0.0.1 (start about 0.3 s, restart about 1.3 s). etcd's default
    heartbeat/election timings: shorter ones risk losing the leader on a loaded machine."""

    def __init__(self, workdir: Path, binary: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.binary = binary or find_etcd()
        self.extra_args = extra_args
        self.workdir = Path(workdir)
        self.data_dir = self.workdir / "data"
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        """The registry url (`open_registry`) of this server."""
        return f"etcd://{self.endpoint}"

    def start(self, timeout_s: float = 15.0) -> None:
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.workdir / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}", "--initial-cluster-state", "new",
             "--heartbeat-interval", "100", "--election-timeout", "1000",
             "--logger", "zap", "--log-level", "warn", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.kill()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError as e:
                last = repr(e)
            time.sleep(0.05)
        tail = (self.workdir / "etcd.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"etcd did not become healthy ({last}); log tail:\n{tail}")

    def kill(self) -> None:
        """SIGKILL, as in a crash; the data dir stays for `start` to reuse."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def etcdctl(self, *args: str) -> str:
        """Run etcdctl (v3 API) against this server; returns stdout."""
        env = {**os.environ, "ETCDCTL_API": "3"}
        return subprocess.run(["etcdctl", "--endpoints", self.endpoint, *args], env=env,
                              check=True, capture_output=True, text=True, timeout=10).stdout
