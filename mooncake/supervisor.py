"""`mooncake serve`'s keeper of its workers once the cluster is up.

On one machine `serve` is the workers' process manager, as systemd or Kubernetes is on many: a
worker that dies (a crash, the OOM killer, a kill by hand) is noticed within a poll, its engine
processes are stopped with it (vLLM's EngineCore and workers live in the worker's process group
and would otherwise linger, holding gigabytes), and it is started again with the same command
after a back-off. They are asked first (SIGTERM), as systemd and Kubernetes do, and killed
(SIGKILL) once `stop_grace_s` has passed: killed outright, they left their shared-memory
segments in /dev/shm (vLLM's, hundreds of MB each, and the multiprocessing resource tracker
that would unlink them died with them). A restart waits until the group is gone. A worker that
keeps dying is given up on after `max_restarts` within `window_s`, and the cluster goes on with
the others (the conductor routes around it and its /health says "degraded"). A restarted
worker whose engine fails to start stays alive saying so on /health (`probe`): it is stopped
(SIGTERM, and SIGKILL if it is still there after `stop_grace_s`) and counted as a death, like one
that exited. Pure but for the processes: the clock, the spawning
and the probe are passed in.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from mooncake import defaults

log = logging.getLogger(__name__)


class Supervised(Protocol):
    role: str
    url: str
    process: subprocess.Popen


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = defaults.WORKER_MAX_RESTARTS
    """Restarts allowed within window_s; one more death and the worker stays down."""
    window_s: float = defaults.WORKER_RESTART_WINDOW_S
    first_delay_s: float = 1.0
    """Back-off before the first restart, doubled for each restart within window_s."""
    max_delay_s: float = 30.0
    stop_grace_s: float = 5.0
    """How long a dead worker's engine processes have to exit after SIGTERM before SIGKILL."""
    start_timeout_s: float = defaults.WORKER_START_TIMEOUT_S
    """A restarted worker neither ready nor failed after this long (a load stuck on a lock, a
    hung device) is stopped and counted as a death, like one whose engine failed."""

    def __post_init__(self) -> None:
        if (self.max_restarts < 0 or self.window_s <= 0 or not 0 <= self.first_delay_s <= self.max_delay_s
                or self.stop_grace_s < 0 or not self.start_timeout_s > 0):
            raise ValueError("need max_restarts >= 0, window_s > 0, 0 <= first_delay_s <= max_delay_s, "
                             f"stop_grace_s >= 0 and start_timeout_s > 0: {self}")


KILLED_WAIT_S = 30.0
"""How long a restart waits for a killed worker's processes to be gone."""


class Supervisor:
    def __init__(self, workers: list[Supervised], spawn: Callable[[Supervised], subprocess.Popen],
                 policy: RestartPolicy, clock: Callable[[], float],
                 probe: Callable[[str], dict | None] | None = None, halted: Callable[[], bool] = lambda: False):
        """`probe(url)`: the worker's /health body (None: no answer yet), asked of restarted
        workers until they are ready. `halted()`: the cluster is stopping, so nothing is started
        again (a check still under way when `serve` stopped the workers started one after them)."""
        self._workers = workers
        self._probe = probe
        self._halted = halted
        self._starting: dict[str, float] = {}  # restarted, not ready yet: url -> when it is given up on
        self._spawn = spawn
        self._policy = policy
        self._clock = clock
        self._restarted: dict[str, list[float]] = {}  # worker url -> when it was restarted
        self._due: dict[str, float] = {}  # worker url -> when its restart is due
        self._stopping: dict[str, tuple[subprocess.Popen, float]] = {}  # url -> (dead leader, SIGKILL at)
        self._terminating: dict[str, float] = {}  # url -> when a live worker told to stop gets SIGKILL
        self.given_up: set[str] = set()

    def check(self) -> None:
        """One poll: notice deaths, stop what they left, start what is due."""
        now = self._clock()
        for w in self._workers:
            self._finish_stopping(w.url, now)
            if w.url in self.given_up:
                continue
            if w.process.poll() is None:
                self._check_start(w, now)
                self._kill_if_overdue(w, now)
                continue
            self._terminating.pop(w.url, None)
            if w.url in self._due:
                if now >= self._due[w.url] and w.url not in self._stopping:
                    self._restart(w, now)
                continue
            # Its engine processes outlive it otherwise; asked first, so they can clean up.
            kill_group(w.process, signal.SIGTERM)
            self._stopping[w.url] = (w.process, now + self._policy.stop_grace_s)
            self._finish_stopping(w.url, now)
            recent = [t for t in self._restarted.get(w.url, []) if now - t < self._policy.window_s]
            self._restarted[w.url] = recent
            code = w.process.returncode
            if len(recent) >= self._policy.max_restarts:
                self.given_up.add(w.url)
                log.error("%s worker %s (pid %d) %s, its %s death within %.0f s: not restarting "
                          "it; the cluster goes on without it", w.role, w.url, w.process.pid, exit_reason(code),
                          _ordinal(len(recent) + 1), self._policy.window_s)
                continue
            delay = min(self._policy.max_delay_s, self._policy.first_delay_s * 2 ** len(recent))
            self._due[w.url] = now + delay
            log.error("%s worker %s (pid %d) %s; restarting it in %.0f s (restart %d of %d within "
                      "%.0f s); its log is above", w.role, w.url, w.process.pid, exit_reason(code), delay, len(recent) + 1,
                      self._policy.max_restarts, self._policy.window_s)

    def _check_start(self, w: Supervised, now: float) -> None:
        """A restarted worker that says its engine failed, or is not ready within the policy's
        start_timeout_s, is stopped: its exit is then a death."""
        if w.url not in self._starting or self._probe is None:
            return
        health = self._probe(w.url) or {}
        if health.get("status") == "ready":
            del self._starting[w.url]
            return
        if health.get("status") == "failed":
            why = f"could not start its engine: {health.get('error') or 'no reason given'}"
        elif now >= self._starting[w.url]:
            why = f"is not ready {self._policy.start_timeout_s:.0f} s after its restart"
        else:
            return
        del self._starting[w.url]
        log.error("restarted %s worker %s (pid %d) %s; stopping it", w.role, w.url, w.process.pid, why)
        kill_group(w.process, signal.SIGTERM)
        self._terminating[w.url] = now + self._policy.stop_grace_s

    def _kill_if_overdue(self, w: Supervised, now: float) -> None:
        """A worker told to stop (its engine failed) that is still there after the grace is
        killed: one that ignored SIGTERM (its shutdown stuck, say on a thread that never ends)
        sat there for ever, neither restarted nor counted, and nothing said so."""
        kill_at = self._terminating.get(w.url)
        if kill_at is None or now < kill_at:
            return
        del self._terminating[w.url]
        log.error("%s worker %s (pid %d) did not stop within %.0f s of SIGTERM; killing it", w.role, w.url,
                  w.process.pid, self._policy.stop_grace_s)
        kill_group(w.process)

    def _finish_stopping(self, url: str, now: float) -> None:
        """The dead worker's group is gone; its grace has passed and it is killed, then waited for
        (a process in uninterruptible sleep, a GPU's teardown, outlives SIGKILL a while, and a new
        engine beside it would find its memory taken) up to KILLED_WAIT_S."""
        if url not in self._stopping:
            return
        leader, kill_at = self._stopping[url]
        if now >= kill_at:
            kill_group(leader)
        if group_running(leader.pid):
            if now < kill_at + KILLED_WAIT_S:
                return
            log.warning("the engine processes of worker %s outlived SIGKILL by %.0f s; restarting it anyway", url,
                        now - kill_at)
        del self._stopping[url]

    def _restart(self, w: Supervised, now: float) -> None:
        if self._halted():  # checked last thing before the spawn: the window left is this line
            return
        del self._due[w.url]
        self._restarted[w.url].append(now)
        try:
            w.process = self._spawn(w)
        except OSError as exc:  # counted as a death: the next poll schedules another try
            log.error("could not restart %s worker %s: %s", w.role, w.url, exc)
            return
        self._starting[w.url] = now + self._policy.start_timeout_s
        log.warning("restarted %s worker %s (pid %d); /health says when it is ready again", w.role, w.url,
                    w.process.pid)


def group_running(pgid: int, proc: str = "/proc") -> bool:
    """Some process of group `pgid` still runs (a zombie waiting for its reaper does not count:
    it holds nothing). Linux: read from /proc, where field 5 of a process's stat is its group."""
    group = str(pgid).encode()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it ended while we looked
        fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and ")"
        if len(fields) > 2 and fields[2] == group and fields[0] != b"Z":
            return True
    return False


def kill_group(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process group `process` leads (it was started with start_new_session), which
    outlives its leader while any member lives. Not once the leader is reaped and the group is
    empty: its id is free then, and may be another session's by now (a worker given up on hours
    before is still signalled at shutdown). Linux hands out no id still in use as a group's."""
    if process.returncode is not None and not group_running(process.pid):
        return
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_reason(code: int | None) -> str:
    """A worker process's exit code, said the way an operator reads it."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}" + (" (the OOM killer?)" if code == -signal.SIGKILL else "")
        except ValueError:
            return f"was killed by signal {-code}"
    known = {defaults.ENGINE_DIED_EXIT_CODE: "its vLLM engine died",
             3: "its HTTP server could not start (its port taken?)", 0: "it stopped"}
    return f"exited with code {code}" + (f" ({known[code]})" if code in known else "")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
