"""Choosing the (prefill, decode) pair for a request.

This is the spine's placeholder policy: least-loaded prefill and least-loaded decode among the
ready workers, by what this conductor has in flight on each. With no prefill worker ready, a
ready decode worker runs the request whole (colocated), so the service degrades instead of
failing.
"""

from __future__ import annotations

from conductor.errors import APIError
from conductor.relay import Route
from conductor.workers import WorkerPool


class Router:
    def __init__(self, pool: WorkerPool):
        self.pool = pool

    def pick(self, prompt: list[int], exclude: set[str] = frozenset(), allow_none: bool = False) -> Route | None:
        prefills = [h for h in self.pool.ready("prefill") if h.name not in exclude and h.role != "decode"]
        decodes = [h for h in self.pool.ready("decode") if h.role != "prefill"]
        if not decodes:
            if allow_none:
                return None
            states = ", ".join(f"{h.http_url} {h.status}" for h in self.pool.all()) or "none configured"
            raise APIError(503, f"no decode worker is ready (workers: {states})", code="workers_unavailable",
                           headers={"Retry-After": "5"})
        decode = min(decodes, key=lambda h: h.in_flight)
        if not prefills:
            if decode.name in exclude:
                return None if allow_none else _unavailable()
            return Route(prefill=decode, decode=decode)
        prefill = min(prefills, key=lambda h: (h.in_flight, h.queued_prefill_tokens))
        return Route(prefill=prefill, decode=decode)


def _unavailable():
    raise APIError(503, "no worker is ready", code="workers_unavailable", headers={"Retry-After": "5"})
