"""The retry benchmark's counting from bench records (benchmarks/retry_after.py)."""

from benchmarks.retry_after import retry_figures


def rec(status: str, attempts: int) -> dict:
    return {"status": status, "attempts": attempts}


def test_retries_refused_again_and_give_ups_are_counted_per_request():
    figures = retry_figures([
        rec("ok", 1),       # never refused
        rec("ok", 2),       # refused once, the retry got in
        rec("ok", 4),       # refused, then refused twice more, then in
        rec("refused", 1),  # refused, and its Retry-After passed the client's patience: gave up
        rec("refused", 3),  # refused, retried twice, refused both times, gave up
        rec("error", 2),    # refused once, the retry was admitted and then failed
    ])
    assert figures == {"refused_once": 5, "retries": 1 + 3 + 0 + 2 + 1, "refused_again": 0 + 2 + 0 + 2 + 0,
                       "gave_up": 2}
