"""Choosing the (prefill, decode) pair for a request with the scheduling core.

The router is the shell around `conductor.core.Scheduler`: it hashes the prompt's blocks with
the same function the workers' KV events are keyed by, builds a ClusterState snapshot from the
ready workers and the conductor's own ledger, asks the core, and turns the answer into a Route
or an HTTP refusal (429 with Retry-After, counted by reason; the Retry-Afters of requests refused
together are spaced by the RetryBook, so they do not all come back at once). It also keeps the
ledger current as requests pass their first token and finish (each admitted request's
RequestLife calls it).

With `remote_fetch` on (the default; --no-remote-fetch turns it off) a decision may carry
Algorithm 1's `fetch_from`: the route then carries a FetchParams for the prefill worker, naming the
holder's KVCache pool (its /health pool_peer), and the prefill worker's pool connector pulls those
blocks before computing the rest. Only a worker whose /health names a pool_peer is offered to the
core as a holder (InstanceState.serves_fetches), so no fetch is priced that cannot happen; one
whose pool went away in between is routed without the fetch (the prefill computes what the fetch
would have brought). Off, each instance is priced by the prefix it holds itself.

Each instance is priced with its own calibrated estimators: the router feeds the prefill and
decode-step times the workers measured (`measured`) to that instance's calibration
(conductor/core/calibration.py), and puts its scales on the instance's InstanceState.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conductor.core.admission import Limits, limits_for
from conductor.core.calibration import Calibration
from conductor.core.estimators import DecodeTimeMeter
from conductor.core.index import PendingPrefixes, PrefixIndex
from conductor.core.retry_book import RetryBook
from conductor.core.scheduler import Scheduler
from conductor.core.types import ClusterState, Decision, InstanceState, Rejection, RejectReason, Request, Role
from conductor.config import worker_block_size_error
from conductor.errors import APIError
from conductor.ledger import predicted_prefill_s
from conductor.metrics import ConductorMetrics
from conductor.slo import RequestSLO, default_class
from conductor.workers import WorkerHandle, WorkerPool
from mooncake.defaults import WorkerRole
from mooncake.hashing import hash_prompt_blocks
from mooncake.protocol import FetchParams

if TYPE_CHECKING:
    from conductor.relay import RelayStats  # the relay imports Route from here

log = logging.getLogger(__name__)

PREFILL_SAMPLE_MAX_CONCURRENT = 2
"""A prefill time is a calibration sample when the engine computed at most this many other
prompts meanwhile. In a stream of long prompts vLLM works first come, first served: a prompt
shares its first step with the previous prompt's last chunk and its last step with the next
one's first, so 2 others, each for one step. Those samples are kept: they carry the slowdown a
loaded host really has (the other engine, the conductor, the clients on the same cores), and
dropping them left only prompts that arrived at an empty queue, which priced a loaded cluster
1.3-2.4x too fast. More than 2 means prompts scheduled together (a burst of short ones): each
one's time is the whole batch's, and one burst of 32 had taught a 10x scale."""

DEFAULT_BANDWIDTH_BPS = 2e9  # until a worker's pushes are measured (WorkerHandle.push_bandwidth)


@dataclass
class Route:
    prefill: WorkerHandle
    decode: WorkerHandle
    request_id: str = ""
    decision: Decision | None = None
    kv_tokens: int = 0
    blocks: tuple = ()  # the prompt's block hashes, pending on `prefill` until its prefill ends
    pending_on: str = ""  # the name `blocks` are pending under (a handle may be renamed meanwhile)
    decoding: bool = False  # its first token came and it has not ended: counted by the decode meter
    decode_held_blocks: int = 0  # leading prompt blocks `decode` holds (prefix index): P skips them
    released: bool = field(default=False)
    fetch: FetchParams | None = None  # Algorithm 1's fetch_from, for the prefill worker
    decided_at: float = 0.0  # when the router picked it (the start of the TTFT it predicted)
    ttft_residual: float = 1.0  # the prefill instance's TTFT residual in that prediction
    ends_at_prefill: bool = False  # the prefill's token is the whole answer: it never decodes
    moved: bool = False  # another worker took its decode over (its TTFT then includes the failure)
    first_token_on_decode: bool = False  # P finished the prompt, and D samples the first token
    # Its prefill instance had sequences decoding when it was routed or when its first token came:
    # the prompt's steps also stepped them, so its prefill time is no bare prefill's.
    prefill_beside_batch: bool = False

    @property
    def colocated(self) -> bool:
        return self.prefill is self.decode


class Router:
    def __init__(self, pool: WorkerPool, index: PrefixIndex, scheduler: Scheduler, metrics: ConductorMetrics,
                 calibration: Calibration | None = None):
        self.pool = pool
        self.index = index
        self.scheduler = scheduler
        self.metrics = metrics
        self.calibration = calibration or Calibration(scheduler.estimators)
        # Blocks the prefills routed but not finished will store: a request routed behind one
        # on the same worker finds them cached (vLLM's prefix cache), before any KV event says so.
        self.pending = PendingPrefixes()
        # t_d for prediction-based admission: Little's law over the sequences decoding, as the
        # simulator measures it (a plain mean of finished decodes is biased low while the pool
        # fills, and one client that leaves after its first token would drag it to ~0).
        self.decode_time = DecodeTimeMeter()
        self._decoding = 0
        # Spaces the Retry-After of requests refused together (conductor/core/retry_book.py).
        self.retries = RetryBook(scheduler.config.max_retry_after_s)
        self._refused: set[str] = set()  # workers already reported for a block-size mismatch

    def _compatible(self, handle: WorkerHandle) -> bool:
        """A worker whose KV block size differs from the conductor's is never routed to (see
        worker_block_size_error); said once per worker, as an error, since it is a misconfiguration."""
        error = worker_block_size_error(handle.block_size, self.scheduler.config.block_size)
        if error is not None and handle.name not in self._refused:
            self._refused.add(handle.name)
            log.error("not routing to %s: %s", handle.name, error)
        return error is None

    def pick(self, request_id: str, prompt: list[int], max_tokens: int, now: float,
             exclude: frozenset[str] | set[str] = frozenset(), allow_none: bool = False,
             slo: RequestSLO | None = None, ends_at_prefill: bool = False) -> Route | None:
        """slo: the request's class, priority and SLOs, which the core admits it by; None, the
        default class's. ends_at_prefill: the prefill's token is the whole answer (core Request)."""
        slo = slo or RequestSLO.of(default_class(self.scheduler.config))
        self.forget_departed()
        handles = {h.name: h for h in self.pool.all()
                   if h.ready and h.name not in exclude and self._compatible(h)}
        # With flexible roles any worker may decode (labels are only a cost to the core).
        flexible = self.scheduler.config.flexible_roles
        decodes = [h for h in handles.values() if flexible or h.serves("decode")]
        if not decodes:
            if allow_none:
                return None
            states = ", ".join(f"{h.http_url} {h.status}" for h in self.pool.all()) or "none configured"
            self.metrics.rejections.labels(reason="no_instance", slo_class=slo.slo_class).inc()
            what = "worker" if flexible else "decode worker"
            raise APIError(503, f"no {what} is ready (workers: {states})", code="workers_unavailable",
                           headers={"Retry-After": "5"})
        # Hashed in the unit the scheduler prices in, which every routed worker shares.
        hashes = tuple(hash_prompt_blocks(prompt, self.scheduler.config.block_size))
        unmeasured = cluster_bandwidth_Bps(handles.values())
        state = ClusterState(instances=tuple(self._instance(h, now, unmeasured) for h in handles.values()),
                             index=self.index,
                             mean_decode_s=self.decode_time.mean_decode_s(now), pending=self.pending)
        request = Request(request_id, len(prompt), hashes, now, slo.priority, slo.ttft_s, slo.tbt_s, ends_at_prefill)
        result = self.scheduler.schedule(request, state, now)
        if isinstance(result, Rejection):
            # With no prefill worker the core prefills on a decode worker (a colocated cluster),
            # under the same SLOs and admission, so every refusal here is a real one.
            if allow_none:
                return None
            if self.scheduler.config.space_retries:
                result = dataclasses.replace(result, retry_after_s=self.retries.promise(result, now))
            self.metrics.rejections.labels(reason=str(result.reason), slo_class=slo.slo_class).inc()
            log.info("rejected %s (%d prompt tokens, class %s): %s, retry after %.1f s", request_id, len(prompt),
                     slo.slo_class, result.reason, result.retry_after_s)
            limits = limits_for(request, self.scheduler.config)
            raise APIError(429, _rejection_message(result, limits, slo), code=str(result.reason),
                           headers={"Retry-After": str(max(1, math.ceil(result.retry_after_s)))})
        if result.best_effort:
            self.metrics.best_effort.labels(slo_class=slo.slo_class).inc()
            log.info("admitted %s best effort on %s: its predicted TTFT %.2f s misses the SLO (%.2f s) even idle, "
                     "and no worker has prefill queued", request_id, result.prefill_instance, result.predicted_ttft_s,
                     limits_for(request, self.scheduler.config).ttft_s)
        route = Route(handles[result.prefill_instance], handles[result.decode_instance], request_id, result,
                      blocks=hashes, decode_held_blocks=self.index.match(hashes).get(result.decode_instance, 0),
                      fetch=fetch_params(result, handles), ends_at_prefill=ends_at_prefill)
        return self._commit(route, prompt, max_tokens, now, result.cached_prefix_tokens, slo.tbt_s)

    def _commit(self, route: Route, prompt: list[int], max_tokens: int, now: float, cached: int,
                tbt_slo_s: float) -> Route:
        route.kv_tokens = len(prompt) + max_tokens
        route.decided_at, route.ttft_residual = now, self.calibration.ttft_residual(route.prefill.name)
        route.prefill_beside_batch = bool(route.prefill.ledger.running)
        seconds = predicted_prefill_s(self.scheduler.estimators, len(prompt), cached,
                                      self.calibration.scales(route.prefill.name)[0])
        # A one-token answer prefilled elsewhere never joins the decode batch (colocated, its
        # prompt's KV still takes the room there), as the core admitted it.
        route.decode.ledger.assign(route.request_id, route.prefill.ledger, seconds, now, route.kv_tokens, tbt_slo_s,
                                   max_tokens, sequence=route.colocated or not route.ends_at_prefill)
        route.pending_on = route.prefill.name
        self.pending.add(route.pending_on, route.blocks)
        self.metrics.routes.labels(kind=_route_kind(route)).inc()
        if route.fetch is not None and route.decision is not None:
            fetched = min(route.decision.fetched_blocks * self.scheduler.config.block_size, route.fetch.num_tokens)
            self.metrics.prefix_fetches.inc()
            self.metrics.prefix_fetch_tokens.inc(fetched)
            log.info("%s: %s fetches %d prefix tokens from %s's pool", route.request_id, route.prefill.name, fetched,
                     route.decision.fetch_from)
        return route

    def first_token(self, route: Route, now: float) -> None:
        route.prefill_beside_batch = route.prefill_beside_batch or bool(route.prefill.ledger.running)
        route.decode.ledger.prefill_done(route.request_id, route.prefill.ledger, now)
        self._prefill_ended(route)
        # A one-token answer never decodes: counted, it would teach the meter a decode of 0 s.
        if not route.decoding and not route.released and not route.ends_at_prefill:
            route.decoding = True
            self._decoding += 1
            self.decode_time.set_decoding(now, self._decoding)
        decision = route.decision
        # A route moved to another worker waited on the failed one: that is no prefill's speed.
        if (decision is not None and not route.moved and not route.first_token_on_decode
                and any(h is route.prefill for h in self.pool.all())):
            # The TTFT it was admitted on, against the one it got (calibration.py: the residual).
            self.calibration.instance(route.prefill.name).observe_ttft(
                now - route.decided_at, decision.predicted_ttft_s, route.ttft_residual)

    def prefill_ended(self, route: Route, now: float) -> None:
        """The prefill worker is done with the prompt and the decode worker will sample the first
        token (Sampling.first_token_on_decode): P's queue moves on now, not at D's first token,
        and that token's TTFT, which includes D's start, teaches P's residual nothing."""
        if route.released or route.colocated:
            return
        route.first_token_on_decode = True
        route.prefill.ledger.prefill_ended(route.request_id, now)
        self._prefill_ended(route)

    def move_decode(self, route: Route, to: WorkerHandle, now: float) -> None:
        """`route`'s decode worker failed before its first token and `to` took the request over:
        its sequence (and, colocated, its prompt's prefill and pending blocks) is counted there,
        so the next requests are priced on the load each worker really has."""
        if route.released or to is route.decode:
            return
        route.moved = True
        colocated = route.colocated
        route.decode.ledger.move(route.request_id, to.ledger, now, prefill_too=colocated)
        if colocated:
            self.pending.discard(route.pending_on, route.blocks)
            route.prefill, route.pending_on = to, to.name
            self.pending.add(route.pending_on, route.blocks)
        route.decode = to

    def _prefill_ended(self, route: Route) -> None:
        """Its blocks are stored now (the worker's KV events follow) or never will be (failure)."""
        self.pending.discard(route.pending_on, route.blocks)
        route.blocks = ()

    def finished(self, route: Route, now: float) -> None:
        if route.released:
            return
        route.released = True
        self._prefill_ended(route)
        route.decode.ledger.finished(route.request_id, route.prefill.ledger, now)
        if route.decoding:  # every sequence that leaves decode is a departure, early ones included
            route.decoding = False
            self._decoding -= 1
            self.decode_time.set_decoding(now, self._decoding)
            self.decode_time.completed(now)

    def measured(self, stats: RelayStats, route: Route, now: float) -> None:
        """What the workers measured for one request (`stats`: its last attempt's, on `route`),
        fed to the instances' calibrations: the prefill time where the prompt was computed, and
        the mean decode step at the mean load the ledger shows on that decode instance over the
        request's decode there, up to `now` (Ledger.decode_load; call before `finished` removes
        it). A request the ledger does not show decoding on the instance its step was measured
        on gives no decode sample: no load to price it at. Time shared with a batch of other
        prompts measures the batch, not the hardware (the queue model prices the wait), so it is
        left out (PREFILL_SAMPLE_MAX_CONCURRENT). So is a prefill that loaded part of its prompt
        from a KVCache pool: its time includes the load, which the estimators price apart (by
        tier), and would teach the compute fit a slower host than it is. So is a prefill computed
        beside a running batch (`route.prefill_beside_batch`): each of its steps also stepped the
        batch, which the scheduler prices apart (chunked_prefill_s), and fitted as a bare prefill it
        taught a scale of 1.94 where the engine was as fast as its profile."""
        handles = {h.name: h for h in self.pool.all()}
        beside_batch = route.prefill_beside_batch and route.prefill.name == stats.prefill_instance
        if (stats.prefill_s is not None and stats.prefill_instance in handles and not stats.prefill_loaded_tokens
                and not beside_batch and _at_most(stats.prefill_concurrent, PREFILL_SAMPLE_MAX_CONCURRENT)):
            self.calibration.instance(stats.prefill_instance).observe_prefill(
                stats.prompt_tokens, stats.computed_cached_tokens, stats.prefill_s)
        if (stats.decode_step_s is not None and stats.decode_instance in handles
                and _at_most(stats.decode_concurrent, 0)):
            load = handles[stats.decode_instance].ledger.decode_load(route.request_id, now)
            if load is not None:
                self.calibration.instance(stats.decode_instance).observe_decode_step(*load, stats.decode_step_s)

    def where_cached(self, prompt: list[int]) -> dict:
        """Where the prefix index places `prompt`'s blocks: each instance's longest cached prefix,
        and how much of it is only in that instance's KVCache pool, by tier. For operators asking
        why a request went where it did (and for tests that must wait for particular blocks)."""
        block_size = self.scheduler.config.block_size
        hashes = tuple(hash_prompt_blocks(prompt, block_size))
        urls = {h.name: h.http_url for h in self.pool.all()}
        held = sorted(self.index.match(hashes).items(), key=lambda item: (-item[1], item[0]))
        return {"prompt_tokens": len(prompt), "block_size": block_size, "blocks": len(hashes),
                "instances": [{"instance": name, "url": urls.get(name), "cached_blocks": n,
                               "pool_only_blocks": self.index.pool_only_blocks(name, hashes, n)}
                              for name, n in held]}

    def forget_departed(self) -> None:
        """Drop the calibrations of instances that left the pool."""
        self.calibration.retain({h.name for h in self.pool.all()})

    def _instance(self, h: WorkerHandle, now: float, unmeasured_Bps: float = DEFAULT_BANDWIDTH_BPS) -> InstanceState:
        role = Role.PREFILL if h.role == WorkerRole.PREFILL else Role.DECODE
        return h.ledger.state(h.name, role, h.kv_capacity_tokens,
                              h.push_bandwidth.estimate_Bps or unmeasured_Bps, self.calibration.scales(h.name),
                              now, h.chunk_tokens, serves_fetches=bool(h.pool_peer))


def cluster_bandwidth_Bps(handles) -> float:
    """What a worker whose pushes were never measured is priced at: the median of the measured
    workers' push bandwidth (the same wire and copies: a decode worker that never pushes still
    serves pool fetches over it; measured pushes here ran at 0.6-1 GB/s, a third to a half of the
    default), or DEFAULT_BANDWIDTH_BPS while no worker is measured."""
    measured = [h.push_bandwidth.estimate_Bps for h in handles if h.push_bandwidth.estimate_Bps]
    return statistics.median(measured) if measured else DEFAULT_BANDWIDTH_BPS


def fetch_params(decision: Decision, handles: dict[str, WorkerHandle]) -> FetchParams | None:
    """The prefill worker's fetch instruction for a decision with fetch_from, if the holder's
    pool can be reached (else None: the prompt's prefix is computed instead)."""
    holder = handles.get(decision.fetch_from or "")
    if holder is None or not holder.pool_peer or decision.fetched_blocks <= 0:
        return None
    return FetchParams(peer=holder.pool_peer, num_tokens=decision.cached_prefix_tokens)


def _route_kind(route: Route) -> str:
    """colocated: P = D; disaggregated: a prefill-labelled P, a decode-labelled D; flexible: a
    pair that breaks a label (flexible roles), e.g. P and D both prefill-labelled."""
    if route.colocated:
        return "colocated"
    if route.prefill.role == WorkerRole.DECODE or route.decode.role == WorkerRole.PREFILL:
        return "flexible"
    return "disaggregated"


def _rejection_message(r: Rejection, limits: Limits, slo: RequestSLO) -> str:
    # The limits are the request's SLOs, less the headroom kept for more important classes.
    parts = {
        RejectReason.TTFT_SLO: f"no instance can produce the first token within {limits.ttft_s:.2f} s",
        RejectReason.TBT_SLO: f"no decode instance can take this request within a TBT of {limits.tbt_s * 1000:.0f} ms "
                              f"(nor of its running requests' own TBT SLOs)",
        RejectReason.NO_CAPACITY: "no decode instance has KV cache room for this request",
    }
    text = parts.get(r.reason, str(r.reason))
    if r.predicted_ttft_s is not None:
        text += f" (predicted TTFT {r.predicted_ttft_s:.2f} s)"
    text += f" [SLO class {slo.slo_class}, priority {slo.priority}]"
    if not r.retry_can_help:
        return (f"{text}; this request misses the SLO even on an idle cluster, so retrying will not help "
                f"(shorten the prompt or max_tokens)")
    if r.unattainable:
        return (f"{text}; this request misses the SLO even on an idle cluster, so it is served best effort "
                f"once no worker has prefill queued: retry after {math.ceil(r.retry_after_s)} s")
    return f"{text}; retry after {math.ceil(r.retry_after_s)} s"


def _at_most(concurrent: int | None, limit: int) -> bool:
    """A worker's count of prompts computed meanwhile is within limit (None: not counted, so no)."""
    return concurrent is not None and concurrent <= limit
