"""Running one measurement: a target and an initiator worker (benchmarks/transfer/common.py's
protocol) as subprocesses, every wait bounded, both always stopped.

Workers print JSON objects one per line on stdout; anything else there (NIXL logs to stdout) and
everything on stderr is kept for the error message, and progress lines ("  [hh:mm:ss] ...") are
passed through to our stderr as they come.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from benchmarks.transfer.common import Plan

READY_TIMEOUT_S = 120.0  # a loaded machine starts a peer's engine slowly
VERIFY_TIMEOUT_S = 300.0


class WorkerFailed(RuntimeError):
    """A worker exited, timed out or said it cannot run here (`unavailable` is then its reason)."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


@dataclass
class WorkerSpec:
    """How to start one kind of worker: argv before the role, its environment, its directory."""

    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    wire: str = "tcp"


@dataclass
class _Process:
    popen: subprocess.Popen
    objects: "queue.Queue[dict | None]" = field(default_factory=queue.Queue)
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    verbose: bool = False
    stderr_reader: threading.Thread | None = None

    def start_readers(self) -> None:
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.stderr_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.stderr_reader.start()

    def _read_stdout(self) -> None:
        for line in self.popen.stdout:
            if line.startswith("{"):
                try:
                    self.objects.put(json.loads(line))
                    continue
                except json.JSONDecodeError:
                    pass
            self._other(line)
        self.objects.put(None)  # end of output

    def _read_stderr(self) -> None:
        for line in self.popen.stderr:
            if line.startswith("  ["):
                sys.stderr.write(line)
            else:
                self._other(line)

    def _other(self, line: str) -> None:
        self.tail.append(line.rstrip())
        if self.verbose:
            sys.stderr.write("    | " + line)

    def next_object(self, deadline: float, what: str) -> dict:
        try:
            obj = self.objects.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise WorkerFailed(f"no {what} before the deadline; last output:\n" + self.output()) from None
        if obj is None:
            status = self.popen.wait()
            self.stderr_reader.join(timeout=5)  # its last lines say why
            raise WorkerFailed(f"exited ({status}) before {what}; last output:\n" + self.output())
        if "unavailable" in obj:
            raise WorkerFailed(obj["unavailable"], unavailable=True)
        return obj

    def output(self) -> str:
        return "\n".join(list(self.tail)[-15:])

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.stdin.close()
                self.popen.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait()


def _spawn(spec: WorkerSpec, role: str, plan: Plan, label: str, peer: dict | None, verbose: bool) -> _Process:
    argv = [*spec.argv, role, "--plan", plan.to_json(), "--wire", spec.wire, "--label", label]
    if peer is not None:
        argv += ["--peer", json.dumps(peer)]
    popen = subprocess.Popen(argv, env=spec.env, cwd=spec.cwd, text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = _Process(popen, verbose=verbose)
    proc.start_readers()
    return proc


def run_pair(spec: WorkerSpec, plan: Plan, label: str, timeout_s: float, verbose: bool = False) -> list[dict]:
    """Target, then initiator; returns the initiator's results with the writes' check filled in."""
    target = _spawn(spec, "target", plan, label, None, verbose)
    try:
        ready = target.next_object(time.monotonic() + READY_TIMEOUT_S, "ready line")["ready"]
        results = run_alone(spec, plan, label, timeout_s, verbose, peer=ready)
        target.popen.stdin.write("verify\n")
        target.popen.stdin.flush()
        verified = target.next_object(time.monotonic() + VERIFY_TIMEOUT_S, "verify answer")["verified"]
    finally:
        target.stop()
    for result in results:
        if result["op"] == "write":
            result["verified"] = verified
    return results


def run_alone(spec: WorkerSpec, plan: Plan, label: str, timeout_s: float, verbose: bool = False,
              peer: dict | None = None) -> list[dict]:
    """The initiator alone (memcpy has no target): its results, in order."""
    initiator = _spawn(spec, "initiator", plan, label, peer, verbose)
    deadline = time.monotonic() + timeout_s
    results: list[dict] = []
    write_verified = None
    try:
        while True:
            try:
                obj = initiator.next_object(deadline, "all results")
            except WorkerFailed as failed:
                if not failed.unavailable and results and initiator.popen.wait(timeout=30) == 0:
                    break  # clean end of output
                raise
            if "write_verified" in obj:
                write_verified = obj["write_verified"]
            else:
                results.append(obj)
    finally:
        initiator.stop()
    if write_verified is not None:
        for result in results:
            if result["op"] == "write":
                result["verified"] = write_verified
    return results
