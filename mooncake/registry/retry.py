"""The one retry policy of the registry: exponential backoff with a cap, forever, only on the
exceptions that mean "the backend is unavailable" (anything else is a bug and propagates).

Built on tenacity. Use it either to call a coroutine function,

    await retrying(0.2, 5.0, RegistryUnavailable)(registry.register, info, ttl_s=5.0)

or as an async iterator of attempts when the caller must act between attempts (a watcher
emits its "outage" event after the first failure, before the first sleep):

    async for attempt in retrying(cfg.retry_min_s, cfg.retry_max_s, RegistryUnavailable):
        with attempt:
            snap = await registry.snapshot()

A fresh object per operation: its delay starts again at `min_s`, which is the reset after a
success that the old hand-written Backoff needed.
"""

from __future__ import annotations

import logging

import tenacity

log = logging.getLogger(__name__)


def retrying(min_s: float, max_s: float,
             unavailable: type[BaseException] | tuple[type[BaseException], ...],
             final: type[BaseException] | tuple[type[BaseException], ...] = ()) -> tenacity.AsyncRetrying:
    """Delays min_s, 2*min_s, 4*min_s, ... capped at max_s; each retry is logged at WARNING
    with its delay and the exception. `final`: kinds of `unavailable` that no retry helps (they
    propagate at once)."""
    if not 0 < min_s <= max_s:
        raise ValueError(f"need 0 < min_s <= max_s, got {min_s}, {max_s}")
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception_type(unavailable) & tenacity.retry_if_not_exception_type(final),
        wait=tenacity.wait_exponential(multiplier=min_s, min=min_s, max=max_s),
        stop=tenacity.stop_never,
        before_sleep=tenacity.before_sleep_log(log, logging.WARNING),
        reraise=True,
    )
