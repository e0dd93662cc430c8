"""When to tell a refused request to come back, so that requests refused together do not all
come back together.

The scheduler prices one request's Retry-After alone: when the predicted queues will have
drained enough for it (scheduler._ttft_retry, admission.decode_drain_s). Under overload many
requests are refused within the same second and each is told the same short wait; clients that
obey it come back together, the first takes the room the drain made, and the rest are refused
again (a live run had 86 of 87 such retries refused again, every one told 1 s).

The book keeps, per resource (prefill compute, decode slots), the time until which the retries
already promised will keep it busy, as a fluid queue: a refusal is told the later of its own
drain and that time, and pushes it on by its own share of the resource (Rejection.slot_s: its
predicted prefill over the instances that may prefill it, or the mean gap between decode
departures). So the n-th request refused in a burst is told to come back once the n-1 before it
could have been served. A promise that is not kept (a client that gives up) leaves its share
unused; the book never holds more than the configured ceiling of Retry-After ahead, so that cost
is bounded. Pure, with an explicit clock, like the rest of the core.
"""

from __future__ import annotations

from conductor.core.types import Rejection, RejectReason

__all__ = ["RetryBook", "resource_of"]


def resource_of(reason: RejectReason) -> str:
    """The resource a refusal waits for: prefill compute for the TTFT SLO, decode otherwise."""
    return "prefill" if reason is RejectReason.TTFT_SLO else "decode"


class RetryBook:
    def __init__(self, max_ahead_s: float) -> None:
        if not max_ahead_s > 0:
            raise ValueError(f"max_ahead_s must be positive, got {max_ahead_s}")
        self.max_ahead_s = max_ahead_s
        self._busy_until: dict[str, float] = {}

    def promise(self, rejection: Rejection, now: float) -> float:
        """Seconds from `now` to tell this refusal to wait, and book its share after that. A
        refusal that no wait can help keeps its own answer (the ceiling) and books nothing."""
        if not rejection.retry_can_help:
            return rejection.retry_after_s
        resource = resource_of(rejection.reason)
        # Waits, not times: (now + r) - now can come out a hair above r, which the whole-second
        # header would round up.
        wait = min(max(rejection.retry_after_s, self._busy_until.get(resource, now) - now), self.max_ahead_s)
        self._busy_until[resource] = now + wait + max(rejection.slot_s, 0.0)
        return wait

    def backlog_s(self, now: float) -> dict[str, float]:
        """Seconds ahead each resource is promised to refused requests (0 when none is)."""
        return {r: max(t - now, 0.0) for r, t in self._busy_until.items()}
