"""`serve` restarts a worker that dies once the cluster is up, kills the engine processes it
left behind, backs off, and gives up on one that keeps dying (mooncake/supervisor.py).

The workers are real processes (Python one-liners in their own process groups, as `serve`
starts them), the clock is the test's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from mooncake.supervisor import RestartPolicy, Supervisor, group_running, kill_group
from tests.supervised_workers import DIES_LEAVING_A_CHILD, LIVES, Worker, procs, wait_exit  # noqa: F401 (procs: a fixture)


def test_a_dead_worker_is_restarted_after_its_back_off_and_its_engine_processes_are_killed(procs):
    now = [100.0]
    worker = Worker("decode", "http://w1", None, DIES_LEAVING_A_CHILD)
    worker.process = procs(worker)
    keeper = Supervisor([worker], procs, RestartPolicy(max_restarts=3, window_s=60, first_delay_s=2),
                        lambda: now[0])
    first = worker.process
    wait_exit(first)
    assert group_running(first.pid)  # the child it started outlives it
    keeper.check()
    deadline = time.monotonic() + 10
    while group_running(first.pid):  # SIGKILLed with its group
        assert time.monotonic() < deadline, "the dead worker's engine process was left running"
        time.sleep(0.05)
    assert worker.process is first  # not yet: the back-off runs
    now[0] += 1.9
    keeper.check()
    assert worker.process is first
    now[0] += 0.2
    worker.code = LIVES
    keeper.check()
    assert worker.process is not first and worker.process.poll() is None
    keeper.check()
    assert not keeper.given_up


def test_the_back_off_doubles_and_a_worker_that_keeps_dying_is_given_up(procs):
    now = [0.0]
    worker = Worker("prefill", "http://w2", None, "import sys; sys.exit(1)")
    worker.process = procs(worker)
    keeper = Supervisor([worker], procs, RestartPolicy(max_restarts=2, window_s=100, first_delay_s=1),
                        lambda: now[0])
    delays = []
    for _ in range(2):
        dead = worker.process
        wait_exit(dead)
        keeper.check()  # noticed: its restart is scheduled
        started = now[0]
        while worker.process is dead:
            now[0] += 0.5
            keeper.check()
        delays.append(now[0] - started)
    assert delays == [1.0, 2.0]
    wait_exit(worker.process)
    keeper.check()
    assert keeper.given_up == {"http://w2"}
    last = worker.process
    now[0] += 1000
    keeper.check()
    assert worker.process is last  # stays down


def test_restarts_older_than_the_window_are_forgiven(procs):
    now = [0.0]
    worker = Worker("decode", "http://w3", None, "import sys; sys.exit(1)")
    worker.process = procs(worker)
    keeper = Supervisor([worker], procs, RestartPolicy(max_restarts=1, window_s=10, first_delay_s=0),
                        lambda: now[0])
    wait_exit(worker.process)
    keeper.check()
    keeper.check()  # restarted once: the limit
    wait_exit(worker.process)
    now[0] += 11  # out of the window: its next death is restarted again
    dead = worker.process
    keeper.check()
    keeper.check()
    assert worker.process is not dead and not keeper.given_up


def test_a_live_worker_is_left_alone(procs):
    worker = Worker("decode", "http://w4", None, LIVES)
    worker.process = procs(worker)
    first = worker.process
    keeper = Supervisor([worker], procs, RestartPolicy(), lambda: 0.0)
    keeper.check()
    assert worker.process is first and first.poll() is None


def test_the_policy_refuses_nonsense():
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=60, max_delay_s=30)
    with pytest.raises(ValueError):
        RestartPolicy(stop_grace_s=-1)


def test_a_group_runs_while_a_member_runs_and_not_once_only_zombies_are_left(tmp_path):
    # A fake /proc: process 10 of group 7 is a zombie (it holds nothing), 11 of group 8 runs,
    # with ") " in its name, which the parse must not split on.
    for pid, stat in ((10, "10 (engine) Z 1 7 7 0"), (11, "11 (a) b) S 1 8 8 0"), (12, "12 (x) S 1 9 9 0")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    (tmp_path / "self").mkdir()
    assert not group_running(7, str(tmp_path))
    assert group_running(8, str(tmp_path))
    assert not group_running(99, str(tmp_path))


def test_a_real_group_runs_until_its_last_member_ends():
    child = subprocess.Popen([sys.executable, "-c", LIVES], start_new_session=True)
    try:
        assert group_running(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not group_running(child.pid)


# A worker whose child (as vLLM's EngineCore) takes a second to shut down on SIGTERM, writing
# `done` when it has; the worker itself exits at once on SIGTERM.
SLOW_CHILD = ("import pathlib, signal, sys, time\n"
              "def bye(*_):\n"
              "    time.sleep(1.0); pathlib.Path(sys.argv[1]).write_text('done'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\n"
              "pathlib.Path(sys.argv[1] + '.ready').touch()\n"
              "time.sleep(120)\n")
LEADER = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
          "time.sleep(120)\n")


def test_stopping_the_cluster_lets_the_engine_processes_shut_down_before_killing_them(tmp_path):
    from mooncake.launcher import Cluster, WorkerProcess

    done = tmp_path / "child-done"
    leader = subprocess.Popen([sys.executable, "-c", LEADER, SLOW_CHILD, str(done)], start_new_session=True)
    cluster = Cluster(config=None, cluster_token="t")  # stop() needs only the workers
    cluster.workers = [WorkerProcess("decode", "http://127.0.0.1:1", leader)]
    deadline = time.monotonic() + 30
    while not (tmp_path / "child-done.ready").exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    cluster.stop(grace_s=10.0)
    assert done.read_text() == "done"  # it finished its shutdown: not SIGKILLed when its leader exited
    assert not group_running(leader.pid)


# A worker that dies leaving a child: the slow one above, or one that ignores SIGTERM.
DIES_LEAVING = ("import subprocess, sys, time\n"
                "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
                "time.sleep(0.5); sys.exit(3)\n")
DEAF_CHILD = ("import pathlib, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "pathlib.Path(sys.argv[1] + '.ready').touch()\n"
              "time.sleep(120)\n")


def _dying_worker(tmp_path, child: str, started: list) -> tuple[Worker, Callable]:
    def spawn(worker: Worker) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", worker.code, child, str(tmp_path / "child-done")],
                                start_new_session=True)
        started.append(proc)
        return proc

    worker = Worker("decode", "http://w5", None, DIES_LEAVING)
    worker.process = spawn(worker)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child-done.ready").exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    wait_exit(worker.process)
    return worker, spawn


def test_a_dead_workers_engine_processes_are_asked_to_stop_and_the_restart_waits_for_them(tmp_path):
    started: list[subprocess.Popen] = []
    try:
        worker, spawn = _dying_worker(tmp_path, SLOW_CHILD, started)
        dead = worker.process
        now = [0.0]
        keeper = Supervisor([worker], spawn, RestartPolicy(first_delay_s=0, stop_grace_s=30), lambda: now[0])
        keeper.check()  # SIGTERM: the child takes a second to shut down
        keeper.check()
        assert worker.process is dead and group_running(dead.pid)  # restart waits for the group
        deadline = time.monotonic() + 20
        while worker.process is dead:
            assert time.monotonic() < deadline, "never restarted"
            time.sleep(0.1)
            keeper.check()
        assert (tmp_path / "child-done").read_text() == "done"  # it shut down cleanly, not killed
        assert not group_running(dead.pid)
    finally:
        for proc in started:
            kill_group(proc)


def test_engine_processes_that_ignore_sigterm_are_killed_after_the_grace(tmp_path):
    started: list[subprocess.Popen] = []
    try:
        worker, spawn = _dying_worker(tmp_path, DEAF_CHILD, started)
        dead = worker.process
        now = [0.0]
        keeper = Supervisor([worker], spawn, RestartPolicy(first_delay_s=0, stop_grace_s=5), lambda: now[0])
        keeper.check()
        time.sleep(0.5)
        now[0] = 4.9
        keeper.check()
        assert group_running(dead.pid) and worker.process is dead
        now[0] = 5.0
        keeper.check()  # grace over: SIGKILL
        deadline = time.monotonic() + 10
        while group_running(dead.pid):
            assert time.monotonic() < deadline, "the deaf child was never killed"
            time.sleep(0.05)
        keeper.check()
        assert worker.process is not dead
    finally:
        for proc in started:
            kill_group(proc)


def test_serve_gives_decode_workers_their_own_chunk_size_when_prefill_workers_exist(monkeypatch):
    from mooncake.launcher import Cluster, ClusterConfig

    def chunks(num_prefill: int) -> dict[str, str]:
        cluster = Cluster(ClusterConfig("/models/m", "m", num_prefill=num_prefill, chunk_size=2048,
                                        decode_chunk_size=256), cluster_token="t")
        monkeypatch.setattr(cluster, "spawn", lambda worker: subprocess.Popen(["true"]))
        cluster.start()
        found = {}
        for w in cluster.workers:
            w.process.wait()
            found[w.command[w.command.index("--instance-id") + 1]] = w.command[w.command.index("--chunk-size") + 1]
        return found

    assert chunks(1) == {"prefill-0": "2048", "decode-1": "256"}
    # No prefill worker: the decode workers prefill everything, in the prefill chunk.
    assert chunks(0) == {"decode-0": "2048"}


def test_serve_decode_workers_default_to_the_prefill_chunk_and_register_where_the_conductor_listens(monkeypatch):
    from mooncake.launcher import Cluster, ClusterConfig

    def commands(**options) -> dict[str, tuple[str, ...]]:
        cluster = Cluster(ClusterConfig("/models/m", "m", num_prefill=1, **options), cluster_token="t")
        monkeypatch.setattr(cluster, "spawn", lambda worker: subprocess.Popen(["true"]))
        cluster.start()
        for w in cluster.workers:
            w.process.wait()
        return {w.command[w.command.index("--instance-id") + 1]: w.command for w in cluster.workers}

    def arg(command, flag):
        return command[command.index(flag) + 1]

    found = commands(chunk_size=512)  # as --help says: the decode workers' default is the prefill chunk
    assert arg(found["decode-1"], "--chunk-size") == "512"
    assert arg(found["decode-1"], "--registry") == "embedded+http://127.0.0.1:8000"
    found = commands(host="10.1.2.3", port=9000)  # a conductor bound to one address is only there
    assert {arg(c, "--registry") for c in found.values()} == {"embedded+http://10.1.2.3:9000"}
    assert arg(commands(host="0.0.0.0")["prefill-0"], "--registry") == "embedded+http://127.0.0.1:8000"


def test_a_stop_interrupted_by_a_second_ctrl_c_still_kills_every_worker():
    """A worker still loading ignores SIGTERM; the operator presses Ctrl-C again during the grace."""
    from mooncake.launcher import Cluster, ClusterConfig

    cluster = Cluster(ClusterConfig("/models/m", "m", num_prefill=1), cluster_token="t")
    deaf = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)")
    for role in ("prefill", "decode"):
        process = subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True)
        cluster.workers.append(Worker(role, "http://127.0.0.1:1", process, deaf))
    processes = [w.process for w in cluster.workers]
    time.sleep(0.5)  # the SIGTERM handler is in place

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.stop(grace_s=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    for process in processes:
        assert process.wait(timeout=10) == -signal.SIGKILL


def test_exit_codes_are_said_the_way_an_operator_reads_them():
    from mooncake import defaults
    from mooncake.supervisor import exit_reason

    assert exit_reason(-9) == "was killed by SIGKILL (the OOM killer?)"
    assert exit_reason(-15) == "was killed by SIGTERM"
    assert exit_reason(defaults.ENGINE_DIED_EXIT_CODE).endswith("(its vLLM engine died)")
    assert "port taken" in exit_reason(3)  # uvicorn's startup failure: not our engine's code
    assert exit_reason(1) == "exited with code 1"


def test_a_restart_waits_for_the_killed_group_to_be_gone_up_to_a_limit(monkeypatch):
    """The restart came in the same poll as the SIGKILL: a process in uninterruptible sleep (a
    GPU's teardown) outlives it a while, and the new engine found its memory taken."""
    from mooncake import supervisor

    dead = subprocess.Popen(["true"], start_new_session=True)
    dead.wait(timeout=30)
    lingering = {dead.pid}
    signals = []
    monkeypatch.setattr(supervisor, "group_running", lambda pgid: pgid in lingering)
    monkeypatch.setattr(supervisor, "kill_group", lambda process, sig=signal.SIGKILL: signals.append(sig))
    spawned = []

    def spawn(worker):
        spawned.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return spawned[-1]

    worker = Worker("decode", "http://w9", dead, "")
    now = [0.0]
    keeper = Supervisor([worker], spawn, RestartPolicy(first_delay_s=0, stop_grace_s=5), lambda: now[0])
    try:
        keeper.check()
        assert signals == [signal.SIGTERM] and not spawned
        now[0] = 5.0
        keeper.check()  # grace over: killed, but its group is still there
        assert signals[-1] == signal.SIGKILL and not spawned
        now[0] = 5.0 + supervisor.KILLED_WAIT_S - 1
        keeper.check()
        assert not spawned
        lingering.clear()  # gone at last
        keeper.check()
        assert len(spawned) == 1 and worker.process is spawned[0]

        worker.process.kill()  # dies again, and this time its group never goes
        worker.process.wait(timeout=30)
        lingering.add(worker.process.pid)
        now[0] = 100.0
        keeper.check()
        now[0] = 105.0 + supervisor.KILLED_WAIT_S  # past the wait: restarted anyway, with a warning
        keeper.check()
        keeper.check()
        assert len(spawned) == 2
    finally:
        for proc in spawned:
            proc.kill()
            proc.wait(timeout=30)


def test_a_reaped_leader_whose_group_is_empty_is_never_signalled(monkeypatch):
    """Its id is free: at shutdown, hours after a worker was given up on, it may be another
    session's, and that whole group got SIGTERM and SIGKILL."""
    from mooncake import supervisor

    sent = []
    monkeypatch.setattr(supervisor.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone.wait(timeout=30)
    kill_group(gone, signal.SIGTERM)
    assert sent == []
    alive = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        kill_group(alive, signal.SIGTERM)
        assert sent == [(alive.pid, signal.SIGTERM)]
    finally:
        alive.kill()
        alive.wait(timeout=30)
