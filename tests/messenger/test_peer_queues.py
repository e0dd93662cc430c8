"""The per-peer submission threads of rdma and nixl (messenger/peer_queues.py)."""

import threading
import time

from messenger.api import Batch
from messenger.peer_queues import PeerQueues


def new_batch() -> Batch:
    return Batch(nbytes=0, num_slices=0)


def outcome(batch: Batch, timeout_s: float = 5.0) -> str | None:
    """The batch's error as text (None: it succeeded); fails if it never completes."""
    wait_until(batch.done, timeout_s)
    return None if batch.error is None else str(batch.error)


def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_frozen_peer_holds_up_only_its_own_batches_in_order():
    queues = PeerQueues("test")
    frozen, order = threading.Event(), []
    stuck = new_batch()
    queues.submit("a", stuck, frozen.wait)
    later = [new_batch() for _ in range(3)]
    for i, batch in enumerate(later):
        queues.submit("b", batch, lambda i=i, batch=batch: (order.append(i), batch.complete()))
    for batch in later:
        assert outcome(batch) is None
    assert order == [0, 1, 2] and not stuck.done()
    frozen.set()
    queues.close(wait=True)


def test_an_idle_peers_thread_ends_and_the_next_submit_starts_another():
    queues = PeerQueues("test", idle_s=0.05)
    names = []
    for _ in range(2):
        batch = new_batch()
        queues.submit("a", batch, lambda batch=batch: (names.append(threading.current_thread().name), batch.complete()))
        assert outcome(batch) is None
        wait_until(lambda: queues.lanes() == 0)  # a restarted worker's old name keeps no thread
    assert names == ["test-a", "test-a"]
    assert not [t for t in threading.enumerate() if t.name == "test-a"]
    queues.close(wait=True)


def test_a_submission_that_raises_fails_its_batch_and_not_the_peers_thread():
    queues = PeerQueues("test")
    broken, after = new_batch(), new_batch()
    queues.submit("a", broken, lambda: 1 / 0)
    queues.submit("a", after, after.complete)
    assert "ZeroDivisionError" in str(outcome(broken))
    assert outcome(after) is None
    queues.close(wait=True)


def test_close_fails_what_is_queued_and_what_comes_after():
    queues = PeerQueues("test")
    started, release = threading.Event(), threading.Event()
    running, queued, late = new_batch(), new_batch(), new_batch()
    queues.submit("a", running, lambda: (started.set(), release.wait(), running.complete()))
    started.wait(5.0)
    queues.submit("a", queued, queued.complete)  # never runs: closed before its turn
    closer = threading.Thread(target=queues.close, args=(True,))
    closer.start()
    queues.submit("a", late, late.complete)
    assert "closed" in str(outcome(late))
    release.set()
    closer.join(5.0)
    assert outcome(running) is None and "closed" in str(outcome(queued))


def test_work_no_batch_waits_on_runs_and_is_dropped_at_close():
    """rdma's receive side queues checksum checks (their ack is the peer's to wait for)."""
    queues = PeerQueues("test")
    ran = threading.Event()
    queues.submit("a", None, ran.set)
    assert ran.wait(5.0)
    queues.close(wait=True)
    queues.submit("a", None, lambda: 1 / 0)  # closed: dropped, nothing raised here
