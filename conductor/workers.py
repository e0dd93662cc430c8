"""The conductor's view of its workers, and the HTTP client that talks to them.

WorkerPool holds one WorkerHandle per instance, whatever told us about it (static URLs in the
embedded cluster, the registry in a real one). Health polling marks handles ready or not, and
samples each prefill worker's KV push counters for its measured bandwidth; the conductor also
counts what it has sent to each, which is fresher than any report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import msgspec

from conductor.bandwidth import PushBandwidthMeter
from conductor.ledger import Ledger
from mooncake.auth import TOKEN_ENV, token_headers
from mooncake.defaults import HEALTH_TIMEOUTS_TOLERATED, WorkerRole
from mooncake.protocol import CHUNK_DECODER, ENCODER, HEALTH_DECODER, GenerateChunk, GenerateRequest

log = logging.getLogger(__name__)

LATE_TIMEOUT_SLACK_S = 1.0
"""A /health poll that timed out more than this after its limit was held up by the conductor's
own event loop, not the worker: it is not counted (WorkerClient.check)."""


class WorkerError(RuntimeError):
    """A worker could not be reached, failed the request, or went silent."""

    def __init__(self, message: str, *, started: bool = False, worker: str = ""):
        super().__init__(message)
        self.started = started  # True when tokens were already relayed before the failure
        self.worker = worker  # the failed worker's name, when known (a retry must not pick it)


class StreamWatch:
    """One request's stream from a worker, as the health poller sees it: whether the worker sent
    anything lately, and how to end the wait for its next line when the worker is found frozen."""

    def __init__(self, now: float):
        self.task: asyncio.Task | None = None  # the task awaiting the next line (callers may read each line in a task of its own)
        self.last_line_at = now
        self.waiting = False  # the task is awaiting the worker's next line (not busy with the last)
        self.lost: str | None = None  # why the stream was given up
        self.cancelled = False  # `task` was cancelled by abandon() rather than by its own caller

    def abandon(self, reason: str) -> None:
        self.lost = reason
        if self.waiting and self.task is not None:  # else the reader sees `lost` before it waits again
            self.cancelled = True
            self.task.cancel()


class RequestRefused(WorkerError):
    """The worker's engine refused the request itself as invalid (a regex it cannot compile...):
    a client error, the same on every worker, so it is answered with a 400 and never retried."""


class EngineFailed(WorkerError):
    """The engine ended the request with an error of its own (vLLM's finish_reason "error": its
    grammar rejected a token, a structured-output grammar failed to compile): a server error, as
    vLLM's server answers it (500), never an answer that merely ends with finish_reason "error".
    Not retried: another engine of the same model would end it the same way."""


@dataclass
class WorkerHandle:
    http_url: str
    role: str = "unknown"  # "prefill" | "decode" | "both", from the worker's /health
    instance_id: str = ""
    kv_address: str = ""
    ready: bool = False
    status: str = "unknown"
    last_error: str | None = None
    last_seen: float = 0.0
    slow_health: int = 0  # health polls in a row that timed out (WorkerClient.check)
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    block_size: int = 0  # from the registry (0: not known yet)
    kv_capacity_tokens: int = 0
    chunk_tokens: int = 0  # its engine's tokens per step, from the registry or /health (0: not said; the scheduler's default)
    ledger: Ledger = field(default_factory=Ledger)
    events_seq: int = -1  # last KV event applied to the prefix index (-1: need a snapshot)
    static: bool = False  # given by --prefill-url/--decode-url: kept even when not registered
    push_bandwidth: PushBandwidthMeter = field(default_factory=PushBandwidthMeter)
    pool_peer: str | None = None  # where other workers fetch from its KVCache pool (None: they cannot)
    streams: set[StreamWatch] = field(default_factory=set)  # requests streaming from it now

    def abandon_silent_streams(self, silent_since: float, reason: str) -> int:
        """Give up the streams that have sent nothing since `silent_since`, once the worker has
        stopped answering /health in time: a frozen process or a host gone from the network sends
        no reset, and they would wait token_timeout_s. Streams still sending are left alone: the
        worker is alive."""
        silent = [w for w in self.streams if w.lost is None and w.last_line_at < silent_since]
        for watch in silent:
            watch.abandon(reason)
        return len(silent)

    @property
    def name(self) -> str:
        return self.instance_id or self.http_url

    def serves(self, role: str) -> bool:
        return self.role in (role, WorkerRole.BOTH)


@dataclass
class WorkerPool:
    handles: dict[str, WorkerHandle] = field(default_factory=dict)  # by http_url
    # Left the registry with streams still open: not routed to, but still polled until they end,
    # so that a frozen worker's streams are given up though its lease expired first.
    departed: dict[str, WorkerHandle] = field(default_factory=dict)  # by http_url

    def add(self, url: str, static: bool = False) -> WorkerHandle:
        url = url.rstrip("/")
        handle = self.handles.get(url) or self.departed.pop(url, None) or WorkerHandle(http_url=url)
        self.handles[url] = handle
        handle.static = handle.static or static
        return handle

    def remove(self, url: str) -> None:
        handle = self.handles.pop(url.rstrip("/"), None)
        if handle is not None and handle.streams:
            handle.ready, handle.status, handle.events_seq = False, "departed", -1
            self.departed[handle.http_url] = handle

    def polled(self) -> list[WorkerHandle]:
        """The handles whose /health is polled: the pool's, and the departed still streaming (a
        departed one whose streams have all ended is dropped here)."""
        for url in [url for url, h in self.departed.items() if not h.streams]:
            del self.departed[url]
        return [*self.handles.values(), *self.departed.values()]

    def ready(self, role: str) -> list[WorkerHandle]:
        return [h for h in self.handles.values() if h.ready and h.serves(role)]

    def all(self) -> list[WorkerHandle]:
        return list(self.handles.values())


def can_serve(pool: WorkerPool, flexible_roles: bool) -> bool:
    """Some ready worker can decode a request: with flexible roles any ready worker can, with
    fixed roles only a decode (or both-role) worker. Otherwise every request gets 503."""
    return bool(pool.ready("decode")) or (flexible_roles and any(h.ready for h in pool.all()))


class WorkerClient:
    def __init__(self, token_timeout_s: float, connect_timeout_s: float = 5.0, cluster_token: str | None = None,
                 health_timeouts_tolerated: int = HEALTH_TIMEOUTS_TOLERATED, health_timeout_s: float = 2.0,
                 on_streams_given_up: Callable[[str, int], None] | None = None):
        """`health_timeouts_tolerated`: /health polls in a row that may time out before a ready
        worker is taken out of rotation (ConductorConfig's docstring says why); the next one also
        gives up its streams that sent nothing meanwhile, and tells `on_streams_given_up` (the
        worker's name, how many; 0 after every answered poll). `health_timeout_s`: one poll's limit."""
        self._health_timeouts_tolerated = health_timeouts_tolerated
        self._health_timeout_s = health_timeout_s
        self._on_streams_given_up = on_streams_given_up
        # `read` bounds the silence between two lines of a worker's answer: a stalled or
        # frozen worker becomes an error after token_timeout_s instead of a hung stream.
        # Every call carries the cluster token: the workers' /internal/* routes refuse calls without it.
        # No limit on connections: each request in flight holds one stream per worker it is on
        # (bounded by ConductorConfig.max_in_flight), and httpx's default of 100 would queue the
        # rest, and the health polls behind them, until they failed with PoolTimeout.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(
            connect=connect_timeout_s, read=token_timeout_s, write=30.0, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            headers=token_headers(cluster_token))
        # Aborts sent from streams being closed: the loop keeps only weak references to tasks,
        # so one nobody holds may be collected before it has sent anything.
        self._aborts: set[asyncio.Task] = set()

    async def close(self) -> None:
        await self._http.aclose()

    def _abort_soon(self, handle: WorkerHandle, request_id: str) -> None:
        task = asyncio.ensure_future(self.abort(handle, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def check(self, handle: WorkerHandle) -> None:
        """Refresh one handle from the worker's /health."""
        polled_at = time.monotonic()
        try:
            resp = await self._http.get(f"{handle.http_url}/health", timeout=self._health_timeout_s)
            health = HEALTH_DECODER.decode(resp.content)
            handle.role = health.role or handle.role
            if handle.static or not handle.instance_id:
                # A registered worker's id is the registry's (the newest instance on its URL):
                # a restarted process answers /health before it registers, while the old one's
                # lease still runs, and the two would rename the handle back and forth.
                handle.instance_id = health.instance_id or handle.instance_id
            handle.kv_address = health.kv_address or handle.kv_address
            handle.pool_peer = health.pool_peer
            # Registered workers also say it in the registry; static --prefill-url/--decode-url
            # workers only here.
            handle.chunk_tokens = health.chunk_tokens or handle.chunk_tokens
            handle.status = health.status
            handle.ready = resp.status_code == 200
            handle.last_error = health.error
            handle.last_seen = time.monotonic()
            if health.cluster_token_accepted is False:  # its internal API would refuse every call
                handle.ready, handle.status = False, "unauthorized"
                handle.last_error = (f"the worker refuses this conductor's cluster token: give both the same "
                                     f"--cluster-token-file or {TOKEN_ENV}")
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            if (isinstance(exc, httpx.TimeoutException)
                    and time.monotonic() - polled_at > self._health_timeout_s + LATE_TIMEOUT_SLACK_S):
                # The timeout fired late: this conductor's own event loop was held up, so the
                # worker's silence says nothing (and the lines it sent may wait unread).
                log.info("a /health poll of %s timed out %.1f s late: this conductor is overloaded; not counted",
                         handle.name, time.monotonic() - polled_at - self._health_timeout_s)
                return
            handle.last_error = f"{type(exc).__name__}: {exc}"
            # Only a timeout says a process is frozen or its host gone: a refused connection comes
            # from a live host, whose kernel resets the streams of a process that died (and a
            # draining server closes its listener while it finishes its streams).
            timed_out = isinstance(exc, httpx.TimeoutException)
            handle.slow_health = handle.slow_health + 1 if timed_out else 0
            # A connect timeout is a host gone rather than a busy server: out of rotation at once.
            slow = timed_out and not isinstance(exc, httpx.ConnectTimeout)
            if handle.ready and slow and handle.slow_health <= self._health_timeouts_tolerated:
                log.info("worker %s answered /health slowly (%d in a row); still routed to", handle.name,
                         handle.slow_health)
                return
            handle.ready = False
            handle.status = "unreachable"
            if timed_out and handle.slow_health > self._health_timeouts_tolerated:
                # Each poll of the run looks again: a stream that sent its last line while the
                # first poll waited is given up at the next.
                given_up = handle.abandon_silent_streams(polled_at, (
                    f"{handle.name} stopped answering: {handle.slow_health} /health polls in a row timed out, "
                    f"and the request's stream has been silent since the last one began"))
                if given_up:
                    log.warning("gave up %d stream(s) from %s, silent since it stopped answering /health",
                                given_up, handle.name)
                    if self._on_streams_given_up is not None:
                        self._on_streams_given_up(handle.name, given_up)
            return
        handle.slow_health = 0
        if self._on_streams_given_up is not None:
            # A count of 0: the worker's series exists from its first answer, so that increase()
            # over it sees the first give-up (a counter series born at its first event is not).
            self._on_streams_given_up(handle.name, 0)
        if handle.ready and handle.serves("prefill"):
            await self._measure_push_bandwidth(handle)

    async def _measure_push_bandwidth(self, handle: WorkerHandle) -> None:
        try:
            resp = await self._http.get(f"{handle.http_url}/internal/kv_stats", timeout=2.0)
            stats = resp.json().get("stats") or {}
            handle.push_bandwidth.update(int(stats["pushed_bytes"]), float(stats["push_seconds"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.debug("no KV push counters from %s: %s", handle.name, exc)

    async def generate(self, handle: WorkerHandle, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream a request's chunks. Raises WorkerError on any failure, including the health
        poller giving the stream up (WorkerHandle.abandon_silent_streams); closing the iterator
        early aborts the request on the worker."""
        started = finished = False
        watch = StreamWatch(time.monotonic())
        handle.in_flight += 1
        handle.streams.add(watch)
        try:
            # `waiting` only while this task awaits the worker (its headers may come only with the
            # first token, then each line): the poller's cancel must land in one of those awaits.
            watch.task, watch.waiting = asyncio.current_task(), True
            async with self._http.stream("POST", f"{handle.http_url}/internal/generate",
                                         content=ENCODER.encode(request),
                                         headers={"content-type": "application/json"}) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")[:500]
                    watch.waiting = False
                    raise WorkerError(f"{handle.name} answered {resp.status_code}: {body}", worker=handle.name)
                watch.waiting = False
                lines = resp.aiter_lines()
                while True:
                    if watch.lost:  # given up while this task was busy elsewhere
                        raise WorkerError(watch.lost, started=started, worker=handle.name)
                    watch.task, watch.waiting = asyncio.current_task(), True
                    try:
                        line = await anext(lines, None)
                    finally:
                        watch.waiting = False
                    if line is None:
                        break
                    watch.last_line_at = time.monotonic()
                    if not line:
                        continue
                    chunk = CHUNK_DECODER.decode(line)
                    if chunk.error is not None and chunk.refused and not started:
                        raise RequestRefused(chunk.error)
                    if chunk.error is not None:
                        raise WorkerError(f"{handle.name}: {chunk.error or 'failed'}", started=started,
                                          worker=handle.name)
                    started = started or bool(chunk.token_ids)
                    if chunk.finish_reason == "error":
                        raise EngineFailed(f"{handle.name}: its engine ended the request with an error (see its log)",
                                           started=started, worker=handle.name)
                    finished = chunk.finish_reason is not None  # (closed at this yield: nothing to abort)
                    yield chunk
                    if finished:
                        return
            raise WorkerError(f"{handle.name} ended the stream without finishing", started=started, worker=handle.name)
        except httpx.ReadTimeout as exc:
            watch.waiting = False  # (a timeout waiting for the headers): the abort below is no read
            await self.abort(handle, request.request_id)
            raise WorkerError(f"{handle.name} sent nothing for too long", started=started, worker=handle.name) from exc
        except (httpx.HTTPError, msgspec.DecodeError) as exc:  # a bad line: msgspec names the field
            raise WorkerError(f"{handle.name} failed: {type(exc).__name__}: {exc}", started=started, worker=handle.name) from exc
        except asyncio.CancelledError:
            # The client went away, or the health poller gave the stream up: free the worker's slot
            # (if it ever thaws). The poller's cancel is an error like any other failure of the
            # worker, unless the caller was cancelled too. (Cancelled once it finished, while the
            # answer's connection closes: nothing runs there to abort.)
            if not finished:
                self._abort_soon(handle, request.request_id)
            if watch.cancelled and watch.task is not None and watch.task.uncancel() == 0:
                raise WorkerError(watch.lost or f"{handle.name} stopped answering", started=started, worker=handle.name) from None
            raise
        except GeneratorExit:  # a stop string matched, or the caller closed the stream early
            if not finished:
                self._abort_soon(handle, request.request_id)
            raise
        finally:
            handle.streams.discard(watch)
            handle.in_flight -= 1

    async def abort(self, handle: WorkerHandle, request_id: str) -> None:
        """Best effort: a worker we cannot reach is dead or will finish the request on its own."""
        try:
            await self._http.post(f"{handle.http_url}/internal/abort", json={"request_id": request_id}, timeout=2.0)
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: the conductor is shutting down (client closed)
            log.debug("abort of %s on %s failed: %s", request_id, handle.name, exc)

    async def drop_transfer(self, handle: WorkerHandle, transfer_id: str) -> None:
        """Tell a decode worker to free KV pushed for a request that will not decode there."""
        try:
            await self._http.post(f"{handle.http_url}/internal/kv_drop", json={"transfer_id": transfer_id}, timeout=2.0)
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: shutting down; staging expires by its TTL anyway
            log.debug("dropping transfer %s on %s failed: %s", transfer_id, handle.name, exc)
