"""One admitted request's resources, held by one object and released exactly once.

An admitted request holds: its slot among the requests in flight, its route's ledger entries
(queued prefill on the prefill instance, a sequence coming to or running on the decode
instance), its pending prefix blocks, the workers' token stream, and its metrics (TTFT at the
first token; end-to-end latency and the answered status at the end). RequestLife owns them all
and `release()` gives them all back, once, whatever ended the request: success, an error, a
stop string, a retry on another prefill instance (which releases the old route's entries at
once), or a client that left, even before the first byte of a streamed answer.

Ownership is handed on, never shared: CompletionService.start hands it to its caller (serve, or
the batch of a completions request's prompts: conductor/batch.py), which owns it until it returns;
a streamed answer hands it to its LifeStreamingResponse, whose `__call__` releases it when the
response ends, however it ends (Starlette calls it even when the body iterator never starts).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conductor.metrics import ConductorMetrics, slo_outcome
from conductor.relay import RelayStats
from conductor.routing import Route, Router
from conductor.slo import RequestSLO
from mooncake.protocol import GenerateChunk

log = logging.getLogger(__name__)

CLIENT_GONE = "499"  # nginx's "client closed request": the client left before the answer ended


class RequestLife:
    def __init__(self, request_id: str, endpoint: str, arrived: float, route: Route, router: Router,
                 metrics: ConductorMetrics, live: dict[str, RequestLife], clock: Callable[[], float],
                 slo: RequestSLO):
        self.request_id = request_id
        self.endpoint = endpoint
        self.arrived = arrived
        self.route = route
        self.slo = slo  # its class, priority and SLOs (conductor/slo.py); slo_class labels its metrics
        self.status: str | None = None  # the HTTP status answered, once known; None: the client left
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0  # generated so far, as relayed to the client
        self.chunks: AsyncIterator[GenerateChunk] | None = None  # the workers' stream, once started
        # n > 1: samples whose choice has ended (a stop string) while others go on; the relay
        # closes their workers' streams (Relay.samples).
        self.stopped_samples: set[int] = set()
        self.stats: RelayStats | None = None  # what the relay saw, measured times included
        self.released = False
        self._router = router
        self._metrics = metrics
        self._live = live
        self._clock = clock
        live[request_id] = self  # the in-flight slot: the service's count is len(live)

    @property
    def slo_class(self) -> str:
        return self.slo.slo_class

    def leave_route(self) -> None:
        """The route failed: its ledger entries and pending blocks go now, before another is
        picked, so the failed work is not priced as queued. Idempotent (Router.finished is)."""
        self._router.finished(self.route, self._clock())

    def reroute(self, new: Route) -> None:
        """A retry moved the request to `new` (already committed by the router)."""
        self.leave_route()
        self.route = new

    def first_token(self) -> float:
        now = self._clock()
        self.first_token_at = now
        self._router.first_token(self.route, now)
        ttft = now - self.arrived
        self._metrics.ttft.labels(slo_class=self.slo_class).observe(ttft)
        decision = self.route.decision
        if decision is not None and decision.predicted_ttft_s > 0:
            self._metrics.ttft_prediction.observe(ttft / decision.predicted_ttft_s)
        return now

    def relayed(self, tokens: int, now: float) -> None:
        """`tokens` generated so far, the last of them relayed at `now` (for the mean TBT)."""
        self.tokens, self.last_token_at = tokens, now

    def slo_targets(self) -> tuple[str, float, float]:
        """(SLO class, TTFT SLO s, mean TBT SLO s) this request is judged by: its own."""
        return self.slo.slo_class, self.slo.ttft_s, self.slo.tbt_s

    def _count_slo(self) -> None:
        slo_class, ttft_slo_s, tbt_slo_s = self.slo_targets()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrived
        mean_tbt = None
        if self.tokens >= 2 and self.last_token_at is not None and self.first_token_at is not None:
            mean_tbt = (self.last_token_at - self.first_token_at) / (self.tokens - 1)
        self._metrics.count_slo(slo_class, slo_outcome(self.status, ttft, mean_tbt, ttft_slo_s, tbt_slo_s))

    async def release(self) -> None:
        """Give everything back; idempotent. The accounting is done before the one await (closing
        the workers' stream aborts their requests), so a cancellation there cannot skip it."""
        if self.released:
            return
        self.released = True
        now = self._clock()
        self._live.pop(self.request_id, None)
        started = self.first_token_at is not None
        stats = self.stats
        if stats is not None:  # before `finished` ends its decode on the ledger
            self._router.measured(stats, self.route, now)
        self._router.finished(self.route, now)
        if started:
            self._metrics.e2e.labels(slo_class=self.slo_class).observe(now - self.arrived)
        self._metrics.requests.labels(endpoint=self.endpoint, status=self.status or CLIENT_GONE,
                                      slo_class=self.slo_class).inc()
        self._count_slo()
        chunks, self.chunks = self.chunks, None
        if chunks is not None:
            await chunks.aclose()  # aborts the workers' requests if they are still running


class LifeStreamingResponse(StreamingResponse):
    """A streamed answer that owns its requests' lives (one, or one per prompt of a batch) and
    releases them when the response ends: completed, failed, cancelled on a disconnect, or never
    started at all."""

    def __init__(self, content: AsyncIterator[str], lives: list[RequestLife], **kwargs):
        super().__init__(content, **kwargs)
        self.lives = lives

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # runs the body's own cleanup if it stopped mid-way
            finally:
                await release_all(self.lives)


async def release_all(lives: list[RequestLife]) -> None:
    """Release every life, even when one release is interrupted (a cancellation while a stream
    closes); the first interruption is raised after the rest are released."""
    interrupted: BaseException | None = None
    for life in lives:
        try:
            await life.release()
        except BaseException as exc:
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
