"""The ledger's prefill backlog: jobs in order, the head drained by the time spent on it (conductor/ledger.py)."""

from conductor.core.types import Role
from conductor.ledger import Ledger


def queued(ledger: Ledger, now: float) -> float:
    return ledger.state("p", Role.PREFILL, 1000, 1e9, now=now).queued_prefill_s


def test_a_running_job_counts_only_its_remaining_seconds():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 0.0, 10)
    assert queued(p, 0.0) == 5.0
    assert queued(p, 1.0) == 4.0  # one second of `a` is done
    assert queued(p, 3.0) == 2.0


def test_a_job_that_runs_long_does_not_eat_into_the_jobs_behind_it():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 0.0, 10)
    assert queued(p, 10.0) == 2.0  # `a` overran by 7 s: none of that was `b`'s
    d.prefill_done("a", p, now=10.0)
    assert queued(p, 10.0) == 2.0 and queued(p, 11.5) == 0.5  # `b` started when `a` ended
    assert queued(p, 30.0) == 0.0  # never negative


def test_a_job_behind_the_head_that_ends_first_leaves_the_head_as_it_was():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 0.0, 10)
    d.prefill_done("b", p, now=1.0)  # computed beside `a` in its steps
    assert queued(p, 1.0) == 2.0 and queued(p, 2.0) == 1.0


def test_a_head_that_fails_hands_the_instance_to_the_next_job_when_it_leaves():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 0.0, 10)
    d.finished("a", p, now=5.0)
    assert queued(p, 5.0) == 2.0 and queued(p, 6.0) == 1.0


def test_a_job_that_ends_early_takes_its_unspent_seconds_with_it():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 0.0, 10)
    d.prefill_done("a", p, now=1.0)  # took 1 s, not 3
    assert queued(p, 1.0) == 2.0  # only `b` is left, whole
    d.finished("b", p)  # failed: nothing is left
    assert queued(p, 1.0) == 0.0


def test_an_idle_instance_does_not_bank_idle_time():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 1.0, 0.0, 10)
    d.prefill_done("a", p, now=1.0)
    assert queued(p, 50.0) == 0.0
    d.assign("b", p, 2.0, 50.0, 10)  # arrives at an idle instance after 49 s idle
    assert queued(p, 50.0) == 2.0 and queued(p, 51.0) == 1.0


def test_reading_the_state_is_idempotent_in_time():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 4.0, 0.0, 10)
    assert queued(p, 2.0) == queued(p, 2.0) == 2.0
    assert queued(p, 1.0) == 2.0  # an older clock reading does not refill it


def test_a_sequence_is_expected_at_its_decode_worker_after_the_queue_ahead_of_its_prefill():
    p, d = Ledger(), Ledger()
    d.assign("a", p, 3.0, 0.0, 10)
    d.assign("b", p, 2.0, 1.0, 10)  # 2 s of `a` left ahead of it
    arrivals = {s.start_s for s in d.state("d", Role.DECODE, 1000, 1e9).incoming}
    assert arrivals == {3.0, 5.0}
