"""The retry book spaces the Retry-After of requests refused together (conductor/core/retry_book.py)."""

import pytest

from conductor.core import Rejection, RejectReason
from conductor.core.retry_book import RetryBook, resource_of
from tests.core.core_helpers import decode, prefill, request, scheduler, state


def refusal(retry_s: float, slot_s: float, reason=RejectReason.TTFT_SLO, helps: bool = True) -> Rejection:
    return Rejection("r", reason, retry_s, retry_can_help=helps, slot_s=slot_s)


def test_a_burst_is_told_to_come_back_one_slot_after_another():
    book = RetryBook(max_ahead_s=300.0)
    waits = [book.promise(refusal(3.0, 1.5), now=10.0) for _ in range(4)]
    assert waits == pytest.approx([3.0, 4.5, 6.0, 7.5])
    assert book.backlog_s(10.0) == {"prefill": pytest.approx(9.0)}
    # Time passes: what was promised is behind us, and a refusal gets its own drain again.
    assert book.promise(refusal(3.0, 1.5), now=30.0) == pytest.approx(3.0)
    # A refusal whose own drain is later than the book is told its own drain.
    assert book.promise(refusal(20.0, 1.0), now=31.0) == pytest.approx(20.0)


def test_prefill_and_decode_are_booked_apart():
    book = RetryBook(max_ahead_s=300.0)
    assert book.promise(refusal(2.0, 5.0), now=0.0) == 2.0
    assert book.promise(refusal(2.0, 5.0, RejectReason.TBT_SLO), now=0.0) == 2.0
    assert book.promise(refusal(2.0, 5.0, RejectReason.NO_CAPACITY), now=0.0) == pytest.approx(7.0)
    assert resource_of(RejectReason.TTFT_SLO) == "prefill" and resource_of(RejectReason.NO_CAPACITY) == "decode"


def test_a_refusal_no_wait_helps_keeps_the_ceiling_and_books_nothing():
    book = RetryBook(max_ahead_s=120.0)
    assert book.promise(refusal(120.0, 50.0, helps=False), now=0.0) == 120.0
    assert book.backlog_s(0.0) == {}
    assert book.promise(refusal(1.0, 1.0), now=0.0) == 1.0


def test_the_book_never_looks_further_than_its_ceiling():
    book = RetryBook(max_ahead_s=10.0)
    waits = [book.promise(refusal(1.0, 4.0), now=0.0) for _ in range(5)]
    assert waits == pytest.approx([1.0, 5.0, 9.0, 10.0, 10.0])
    with pytest.raises(ValueError):
        RetryBook(max_ahead_s=0.0)


def test_the_scheduler_prices_a_retry_slot_over_the_instances_that_may_serve_it():
    # 1000 tokens at 1 ms each on either of two prefill instances, both queued past the SLO.
    s = state(prefill("p0", queued=12.0), prefill("p1", queued=15.0), decode("d0"))
    r = scheduler(policy="cache-aware", admission="baseline", ttft_slo_s=10.0).schedule(request(1000), s, 0.0)
    assert r.reason is RejectReason.TTFT_SLO and r.slot_s == pytest.approx(1.0 / 2)
    # Decode refusal: 4 sequences leave in t_d = 8 s, one every 2 s.
    full = state(prefill("p0"), decode("d0", batch=3, cap=400, incoming=1))
    d = scheduler(admission="early", default_decode_s=8.0).schedule(request(1000), full, 0.0)
    assert d.reason is RejectReason.NO_CAPACITY and d.slot_s == pytest.approx(2.0)


def test_a_burst_refused_by_the_scheduler_is_spread_by_the_book():
    s = state(prefill("p0", queued=12.0), decode("d0"))
    sched = scheduler(policy="cache-aware", admission="early", ttft_slo_s=10.0)
    book = RetryBook(sched.config.max_retry_after_s)
    waits = [book.promise(sched.schedule(request(2000, rid=str(i)), s, 0.0), 0.0) for i in range(3)]
    # Each would have been told 4 s alone (12 s queue + 2 s prefill - 10 s); one 2 s prefill apart.
    assert waits == pytest.approx([4.0, 6.0, 8.0])


def test_a_refusals_own_drain_comes_back_exact_for_the_whole_second_header():
    # (3.4524 + 5.0) - 3.4524 is a hair above 5.0 in floating point; ceil would say 6 s.
    assert (3.4524 + 5.0) - 3.4524 > 5.0
    assert RetryBook(max_ahead_s=300.0).promise(refusal(5.0, 1.0), now=3.4524) == 5.0
