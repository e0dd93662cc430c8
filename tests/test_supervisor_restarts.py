"""A restarted worker that does not come back ready (its engine failed, its load hangs, it ignores
SIGTERM) is stopped and counted as a death; nothing restarts once `serve` is stopping
(mooncake/supervisor.py). Real processes, the test's clock."""

from __future__ import annotations

import signal
import time

import pytest

from mooncake.supervisor import RestartPolicy, Supervisor
from tests.supervised_workers import DIES_LEAVING_A_CHILD, LIVES, Worker, procs, wait_exit  # noqa: F401 (procs: a fixture)

EXITS = "import sys; sys.exit(3)"


def died_once(procs, url: str, policy: RestartPolicy, now: list[float], health: dict[str, dict],
              code: str = EXITS) -> tuple[Worker, Supervisor]:
    """A worker that died, its death seen by the supervisor: its restart is due after the back-off."""
    worker = Worker("decode", url, None, code)
    worker.process = procs(worker)
    keeper = Supervisor([worker], procs, policy, lambda: now[0], probe=lambda u: health.get(u))
    wait_exit(worker.process)
    keeper.check()
    return worker, keeper


def test_a_restarted_worker_whose_engine_fails_to_start_is_stopped_and_counted_as_a_death(procs):
    """It stays alive answering /health "failed": without the probe it would sit there for ever."""
    now, health = [0.0], {}
    worker, keeper = died_once(procs, "http://w1", RestartPolicy(max_restarts=3, window_s=60, first_delay_s=0),
                               now, health)
    worker.code = LIVES
    keeper.check()
    restarted = worker.process
    assert restarted.poll() is None
    keeper.check()  # no answer yet: still starting
    health["http://w1"] = {"status": "failed", "error": "RuntimeError: no memory"}
    keeper.check()
    assert restarted.wait(timeout=10) == -signal.SIGTERM
    now[0] += 1.0
    keeper.check()  # its exit is a death: restarted again after the back-off
    keeper.check()
    assert worker.process is not restarted and len(keeper._restarted["http://w1"]) == 2


def test_a_restarted_worker_whose_engine_failed_and_that_ignores_sigterm_is_killed_after_the_grace(procs, caplog):
    """Its shutdown stuck (a thread that never ends): it sat there for ever, not restarted, not counted."""
    now, health = [0.0], {}
    worker, keeper = died_once(procs, "http://w6", RestartPolicy(max_restarts=3, window_s=60, first_delay_s=0,
                                                                 stop_grace_s=5), now, health)
    worker.code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    keeper.check()
    deaf = worker.process
    time.sleep(1.0)  # its SIG_IGN is in place
    health["http://w6"] = {"status": "failed", "error": "RuntimeError: no memory"}
    keeper.check()  # SIGTERM, ignored
    now[0] = 4.9
    keeper.check()
    assert deaf.poll() is None
    now[0] = 5.0
    keeper.check()  # the grace is over
    assert deaf.wait(timeout=10) == -signal.SIGKILL
    assert "did not stop within 5 s of SIGTERM" in caplog.text
    now[0] = 7.0
    keeper.check()  # its death counts: restarted after the back-off
    keeper.check()
    assert worker.process is not deaf and len(keeper._restarted["http://w6"]) == 2


def test_a_restarted_worker_never_ready_is_stopped_after_the_start_timeout_and_counted_as_a_death(procs):
    """One whose load hangs (a lock, a device) answers /health "starting" for ever: without a
    limit the cluster stayed degraded and the worker was neither restarted nor counted."""
    now, health = [0.0], {}
    worker, keeper = died_once(procs, "http://w7", RestartPolicy(max_restarts=3, window_s=6000, first_delay_s=0,
                                                                 start_timeout_s=300), now, health)
    worker.code = LIVES
    keeper.check()
    restarted = worker.process
    health["http://w7"] = {"status": "starting"}
    now[0] += 299
    keeper.check()
    assert restarted.poll() is None  # still within its start timeout
    now[0] += 2
    keeper.check()
    assert restarted.wait(timeout=10) == -signal.SIGTERM
    now[0] += 1.0
    keeper.check()  # its exit is a death: restarted again after the back-off
    keeper.check()
    assert worker.process is not restarted and len(keeper._restarted["http://w7"]) == 2


def test_a_start_timeout_must_be_positive():
    with pytest.raises(ValueError, match="start_timeout_s"):
        RestartPolicy(start_timeout_s=0)


def test_nothing_is_restarted_once_the_cluster_is_stopping(procs):
    """serve stops its workers after the supervisor's thread ends, or after 10 s: a check still
    under way then (slow health probes) restarted a worker after the others were stopped, and
    nobody stopped that one."""
    now, halted = [100.0], [False]
    worker = Worker("decode", "http://w1", None, DIES_LEAVING_A_CHILD)
    worker.process = procs(worker)
    keeper = Supervisor([worker], procs, RestartPolicy(max_restarts=3, window_s=60, first_delay_s=1),
                        lambda: now[0], halted=lambda: halted[0])
    first = worker.process
    wait_exit(first)
    keeper.check()  # its death is seen; the restart is due in 1 s
    now[0] += 2
    halted[0] = True
    worker.code = LIVES
    keeper.check()
    assert worker.process is first  # not restarted: the cluster is stopping
