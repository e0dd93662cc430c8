"""The worker's internal HTTP API (used by the conductor only).

  POST /internal/generate   GenerateRequest JSON -> NDJSON stream of GenerateChunk
  POST /internal/abort      {"request_id": ...}
  POST /internal/kv_drop    {"transfer_id": ...}: free KV pushed here for a request that will not decode here
  POST /internal/reset_prefix_cache  drop the engine's own prefix cache (the KVCache pool keeps its blocks)
  GET  /health              200 when the engine is ready, 503 while it starts, after it died, or draining
  GET  /internal/load       what is queued and running here (for routing)
  GET  /internal/kv_stats   the KV connector's counters
  GET  /internal/kv_events  ?since=SEQ[&wait=S]: prefix blocks stored/removed here (conductor's index);
                            with wait, held up to S seconds until there is something new
  GET  /metrics             Prometheus text

Every /internal/* route asks for the cluster token (X-Mooncake-Cluster-Token, 401 without it;
mooncake/auth.py); /health and /metrics stay open for probes and scrapers. Bodies over
MAX_BODY_BYTES are a 413. Every error is in OpenAI's shape (mooncake/http_errors.py).

The HTTP server is up at once; the engine starts in the background (about 30 s on CPU), and
/health says 503 until it is ready, so a supervisor can tell "starting" from "dead".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from mooncake import defaults
from mooncake.auth import TOKEN_HEADER, ClusterTokenGuard, token_matches
from mooncake.body_limit import BodyLimitMiddleware
from mooncake.control import ControlEndpoint, ControlError, control_call
from mooncake.drain import Drain, wait_idle
from mooncake.http_errors import error_response, install_error_handlers
from mooncake.protocol import (ABORT_DECODER, DROP_DECODER, REQUEST_DECODER, BadTransferParams, GenerateChunk,
                               GenerateRequest, encode_chunk_line, parse_push)
from mooncake.engine.config import WorkerConfig
from mooncake.engine.engine import build_engine, kv_capacity_tokens, refusal, run_request
from mooncake.engine.prefill_overlap import PrefillOverlap
from mooncake.engine.kv_events import (POOL_TIERS, BlockEventLog, BlockHashTranslator, KVEventSubscriber,
                                       LogChanges)

POOL_EVENTS_CHECK_S = 1.0  # a held poll of /internal/kv_events merges the pool's events this often
from mooncake.engine.metrics import WorkerMetrics
from mooncake.engine.stat_logger import engine_stat_logger

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    prompt_tokens: int
    started_at: float
    first_token_at: float | None = None


@dataclass
class WorkerState:
    config: WorkerConfig
    kv_port: int
    events_port: int  # where vLLM publishes KV events: the subscriber's port (0 = any, until it binds)
    control: ControlEndpoint
    engine: object | None = None
    block_size: int = 0
    kv_capacity_tokens: int = 0
    event_log: BlockEventLog = field(default_factory=BlockEventLog)
    subscriber: KVEventSubscriber | None = None
    registry: object | None = None
    register_task: asyncio.Task | None = None
    engine_error: str | None = None
    engine_died: bool = False  # the running engine died (its core process was killed, say)
    on_engine_death: Callable[[], None] | None = None  # stops the server (the runner sets it)
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    prefills: PrefillOverlap = field(default_factory=PrefillOverlap)  # prompts the engine computes at once
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)
    drain: Drain = field(default_factory=Drain)
    pool: object | None = None  # this node's KVCache pool service (store/service.py), if any
    pool_seq: int = -1  # the last pool event merged into event_log
    log_changes: LogChanges | None = None  # wakes held polls of /internal/kv_events

    def pool_stats(self) -> dict:
        """The pool's usage per tier and its counters (empty without a pool); merges its events
        into event_log first, so a conductor's index sees what the pool holds."""
        if self.pool is None:
            return {}
        page = self.pool.events_since(self.pool_seq)
        if page.reset:
            for tier in POOL_TIERS:
                self.event_log.cleared(tier)
        for kind, key, tier in page.events:
            (self.event_log.stored if kind == "stored" else self.event_log.removed)([key], tier)
        self.pool_seq = page.seq
        return self.pool.stats()

    def load(self) -> dict:
        queued = sum(r.prompt_tokens for r in self.in_flight.values() if r.first_token_at is None)
        return {
            "instance_id": self.config.instance_id,
            "role": self.config.role,
            "running_requests": len(self.in_flight),
            "queued_prefill_tokens": queued,
            "kv_tokens_used": sum(r.prompt_tokens for r in self.in_flight.values()),
            "pool": self.pool.stats()["usage"] if self.pool is not None else {},
        }


def create_app(config: WorkerConfig, kv_port: int, events_port: int, control: ControlEndpoint,
               pool_factory=None) -> FastAPI:
    """`pool_factory(config)`: starts this node's KVCache pool service (the composition root
    passes store's; None or config.pool_dram_bytes == 0: no pool)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state: WorkerState = app.state.worker
        if pool_factory is not None and config.pool_dram_bytes > 0:
            # Before the engine: its connector attaches to the pool while vLLM starts.
            state.pool = pool_factory(config)
        # Listen for the engine's KV events before it is built and told the port, so nothing can
        # take the port in between; a bind that fails raises here and uvicorn stops the start-up.
        # (Its reading thread starts once the engine is up, since it imports vLLM; ZMQ queues what
        # arrives meanwhile.)
        state.subscriber = KVEventSubscriber(state.event_log, BlockHashTranslator(), state.events_port)
        state.events_port = state.subscriber.port
        starter = asyncio.create_task(_start_engine(state))
        yield
        starter.cancel()
        if state.register_task is not None:
            state.register_task.cancel()
        if state.registry is not None:
            await _close_registry(state)
        if state.subscriber is not None:
            await asyncio.to_thread(state.subscriber.stop)  # its thread notices within 0.5 s
        engine = state.engine
        if engine is not None:
            engine.shutdown()
        if state.pool is not None:
            state.pool.close()
        shutil.rmtree(os.path.dirname(state.control.path), ignore_errors=True)

    app = FastAPI(title=f"mooncake {config.role} worker", lifespan=lifespan)
    app.state.worker = WorkerState(config=config, kv_port=kv_port, events_port=events_port, control=control)
    install_error_handlers(app)  # every error in OpenAI's shape, validation a 400 (as the conductor's)
    app.add_middleware(BodyLimitMiddleware, max_bytes=defaults.MAX_BODY_BYTES)
    # /internal/* needs the cluster token; /health and /metrics stay open for probes and scrapers.
    app.add_middleware(ClusterTokenGuard, token=config.cluster_token)

    @app.get("/health")
    async def health(request: Request):
        state: WorkerState = request.app.state.worker
        body = {"instance_id": config.instance_id, "role": config.role, "model": config.served_model_name,
                "kv_address": f"{config.public_host}:{state.kv_port}", "chunk_tokens": config.max_num_batched_tokens}
        peer = state.pool.peer_info() if state.pool is not None else None
        if peer is not None:  # other nodes fetch from this pool with it (Algorithm 1's fetch_from)
            body["pool_peer"] = msgspec.json.encode(peer).decode()
        if config.cluster_token is not None:  # so a conductor with another token knows why it is refused
            body["cluster_token_accepted"] = token_matches(request.headers.get(TOKEN_HEADER), config.cluster_token)
        if state.drain.active:  # leaving: the conductors stop routing here
            return JSONResponse({**body, "status": "draining"}, status_code=503)
        if state.engine_error:
            return JSONResponse({**body, "status": "failed", "error": state.engine_error}, status_code=503)
        if state.engine is None:
            return JSONResponse({**body, "status": "starting"}, status_code=503)
        if getattr(state.engine, "errored", False):
            return JSONResponse({**body, "status": "failed", "error": "engine died"}, status_code=503)
        return {**body, "status": "ready"}

    @app.get("/internal/load")
    async def load(request: Request):
        return request.app.state.worker.load()

    @app.get("/internal/kv_events")
    async def kv_events(request: Request, since: int = -1, wait: float = 0.0):
        state: WorkerState = request.app.state.worker
        loop = asyncio.get_running_loop()
        wait = min(max(wait, 0.0), defaults.KV_EVENTS_MAX_WAIT_S) if wait == wait else 0.0  # NaN: no hold
        deadline = loop.time() + wait
        if state.log_changes is None:  # the first poll: from now on the log wakes held polls on this loop
            state.log_changes = LogChanges(loop)
            state.event_log.add_listener(state.log_changes.notify_threadsafe)
        while True:
            changed = state.log_changes.current()  # before the read: a change after it wakes us
            await asyncio.to_thread(state.pool_stats)  # the pool's events join the log first
            page = state.event_log.since(since)
            left = deadline - loop.time()
            if page.reset or page.stored or page.removed or left <= 0 or state.drain.active:
                break
            # The engine's events wake this at once; the pool's are merged on each turn.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, POOL_EVENTS_CHECK_S))
        # Hashes travel as hex: they are 128-bit, beyond what JSON numbers carry safely.
        return {"seq": page.seq, "reset": page.reset, "block_size": request.app.state.worker.block_size,
                "stored": [format(h, "x") for h in page.stored], "removed": [format(h, "x") for h in page.removed],
                "pool_tiers": {format(h, "x"): tier for h, tier in page.pool_tiers.items()}}

    @app.get("/internal/kv_stats")
    async def kv_stats(request: Request):
        return await asyncio.to_thread(_connector_stats, request.app.state.worker.control)

    @app.get("/metrics")
    async def metrics(request: Request):
        state: WorkerState = request.app.state.worker
        # The control call blocks, so it runs in a thread; rendering stays on the event loop, where
        # state.load() reads in_flight without racing _stream's changes to it (and takes microseconds).
        # A connector that does not answer gives empty stats: its counters are left out of this scrape.
        stats = await asyncio.to_thread(_connector_stats, state.control)
        pool = await asyncio.to_thread(state.pool_stats)
        body = state.metrics.render(state.load(), stats.get("stats", {}), stats.get("messenger", {}), pool)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/internal/abort")
    async def abort(request: Request):
        state: WorkerState = request.app.state.worker
        try:
            body = ABORT_DECODER.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error_response(400, f"bad abort request: {exc}", "invalid_value")
        if state.engine is not None:
            await state.engine.abort(body.request_id)
        return {"ok": True}

    @app.post("/internal/kv_drop")
    async def kv_drop(request: Request):
        try:
            body = DROP_DECODER.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error_response(400, f"bad kv_drop request: {exc}", "invalid_value")
        state: WorkerState = request.app.state.worker
        answer = await asyncio.to_thread(_connector_call, state.control,
                                         {"op": "drop", "transfer_id": body.transfer_id})
        # Said as it went: staged KV that the connector did not hear of is freed at its own timeout.
        return {"ok": bool(answer.get("ok"))} | ({"error": answer["error"]} if answer.get("error") else {})

    @app.post("/internal/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        state: WorkerState = request.app.state.worker
        if state.engine is None:
            return error_response(503, "engine is not ready", "not_ready")
        # vLLM refuses (False) while requests hold blocks; the pool is never reset here.
        return {"ok": bool(await state.engine.reset_prefix_cache())}

    @app.post("/internal/generate")
    async def generate(request: Request):
        state: WorkerState = request.app.state.worker
        if state.engine is None or state.drain.active:  # the conductor retries it on another worker
            return error_response(503, "worker is draining" if state.drain.active else "engine is not ready",
                                  "draining" if state.drain.active else "not_ready")
        try:
            gen = REQUEST_DECODER.decode(await request.body())
        except msgspec.DecodeError as exc:  # ValidationError too; its text names the field
            return error_response(400, f"bad generate request: {exc}", "invalid_value")
        if gen.request_id in state.in_flight:
            # vLLM takes a second request of one id, but this shell's books (its load, the drain's
            # wait, the prefill overlap record) are by id: the first to end would erase the other.
            return error_response(409, f"request {gen.request_id} is already running here", "duplicate_request")
        return StreamingResponse(_stream(state, gen), media_type="application/x-ndjson")

    return app


async def _stream(state: WorkerState, gen: GenerateRequest):
    if gen.request_id in state.in_flight:
        # The same id again, arrived while the first's stream had not started (generate's 409
        # check ran for both before either got here): checked again with no await before the entry
        # is taken. An error line, not a 409: the status line has gone already.
        yield encode_chunk_line(GenerateChunk([], finish_reason="error",
                                              error=f"request {gen.request_id} is already running here"))
        return
    entry = InFlight(prompt_tokens=len(gen.prompt_token_ids), started_at=time.monotonic())
    state.in_flight[gen.request_id] = entry
    outcome = "error"
    sent = False
    try:
        push = _push_of(gen)
        async for chunk in run_request(state.engine, gen, state.prefills):
            sent = True
            if push is not None and chunk.finish_reason is not None:
                # The answer must mean "the KV has landed": the connector pushes without holding
                # the engine, so ask it, bounded in time, before the last line.
                chunk = await _with_push_outcome(state.control, push.transfer_id, chunk)
            if entry.first_token_at is None and chunk.token_ids:
                entry.first_token_at = time.monotonic()
                state.metrics.first_token.observe(entry.first_token_at - entry.started_at)
            state.metrics.generated_tokens.inc(len(chunk.token_ids))
            yield encode_chunk_line(chunk)
        outcome = "ok"
    except asyncio.CancelledError:
        outcome = "cancelled"  # the conductor went away; vLLM aborts the request itself
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the conductor as a final line
        refused = None if sent else refusal(exc)
        if refused is not None:  # the client's error: the conductor answers 400 and retries nowhere
            log.info("request %s refused as invalid: %s", gen.request_id, refused)
            yield encode_chunk_line(GenerateChunk([], finish_reason="error", error=refused, refused=True))
            return
        log.exception("request %s failed", gen.request_id)
        # Never an empty error: vLLM's EngineGenerateError has no message, and the conductor tells
        # a worker's failure (retried elsewhere) from the engine's own finish "error" by this field.
        yield encode_chunk_line(GenerateChunk([], finish_reason="error", error=str(exc) or type(exc).__name__))
    finally:
        state.in_flight.pop(gen.request_id, None)
        state.metrics.prompt_tokens.inc(entry.prompt_tokens)
        state.metrics.requests.labels(outcome=outcome).inc()


async def _start_engine(state: WorkerState) -> None:
    try:
        # Building the engine blocks for tens of seconds; keep the event loop (and /health) free.
        pool = {"pool": state.pool.endpoint} if state.pool is not None else {}
        engine = await asyncio.to_thread(build_engine, state.config, state.kv_port, state.events_port, state.control,
                                         [engine_stat_logger(state.metrics)], **pool)
        state.block_size, state.kv_capacity_tokens = kv_capacity_tokens(engine)
        state.subscriber.start()
        state.engine = engine
        log.info("%s worker %s ready (block size %d, KV capacity %d tokens)", state.config.role,
                 state.config.instance_id, state.block_size, state.kv_capacity_tokens)
        if state.config.registry_url and not state.drain.active:
            state.register_task = asyncio.create_task(_register(state))
            state.register_task.add_done_callback(lambda task: _registration_ended(state, task))
    except Exception as exc:  # noqa: BLE001 - surfaced by /health
        log.exception("engine failed to start")
        state.engine_error = f"{type(exc).__name__}: {exc}"
        return
    await _exit_when_engine_dies(state)


def _registration_ended(state: WorkerState, task: asyncio.Task) -> None:
    """A first registration that failed for good (not one cancelled by a drain) leaves the worker
    unreachable by every conductor: say so in the log and on /health, not nowhere."""
    if task.cancelled() or task.exception() is None:
        return
    exc = task.exception()
    log.error("registering %s at %s failed: %r; no conductor will route here", state.config.instance_id,
              state.config.registry_url, exc)
    state.engine_error = f"registration failed: {type(exc).__name__}: {exc}"


async def _exit_when_engine_dies(state: WorkerState, poll_s: float = 1.0) -> None:
    """A worker whose engine died (its core process killed by the OOM killer, a crash) cannot
    serve again: it stops, with a non-zero exit code, so whoever runs it (`mooncake serve`'s
    supervisor, Kubernetes) starts a new one. Alive, it would only answer /health "failed"."""
    while not getattr(state.engine, "errored", False):
        await asyncio.sleep(poll_s)
    state.engine_died = True
    log.error("the %s worker %s's engine died; stopping the worker so that it is restarted",
              state.config.role, state.config.instance_id)
    if state.on_engine_death is not None:
        state.on_engine_death()


def _push_of(gen: GenerateRequest):
    try:
        return parse_push(gen.kv_transfer_params)
    except BadTransferParams:  # the connector ignores it too (and logs why)
        return None


async def _with_push_outcome(control: ControlEndpoint, transfer_id: str, chunk: GenerateChunk) -> GenerateChunk:
    """`chunk` with kv_error set when the pushed KV did not land (so D is not made to wait)."""
    timeout_s = defaults.KV_PUSH_ACK_TIMEOUT_S
    reply = await asyncio.to_thread(control_call_or_error, control,
                                    {"op": "push_outcome", "transfer_id": transfer_id, "timeout_s": timeout_s},
                                    timeout_s + 5.0)
    if reply.get("ok"):
        return chunk
    log.warning("KV push %s did not land: %s", transfer_id, reply.get("error"))
    return msgspec.structs.replace(chunk, kv_error=str(reply.get("error") or "unknown"))


def control_call_or_error(control: ControlEndpoint, request: dict, timeout_s: float) -> dict:
    try:
        return control_call(control, request, timeout_s)
    except ControlError as exc:
        return {"ok": False, "error": str(exc)}


def _connector_stats(control: ControlEndpoint) -> dict:
    return _connector_call(control, {"op": "stats"})


def _connector_call(control: ControlEndpoint, request: dict) -> dict:
    """Ask this worker's own connector (it lives in a vLLM process) over the control channel."""
    try:
        return control_call(control, request)
    except ControlError as exc:
        return {"ok": False, "error": str(exc), "stats": {}}


async def _register(state: WorkerState) -> None:
    """Announce this worker once its engine is ready; the registry keeps it alive from then on."""
    from mooncake.registry import InstanceInfo, RegistryConfig, RegistryRefused, RegistryUnavailable, open_registry
    from mooncake.registry.retry import retrying

    c = state.config
    registry = open_registry(RegistryConfig(url=c.registry_url, ttl_s=c.registry_ttl_s, cluster_token=c.cluster_token,
                                            etcd_credentials=c.etcd_credentials))
    state.registry = registry
    info = InstanceInfo(
        instance_id=c.instance_id, role=c.role, http_url=c.http_url,
        kv_address=f"{c.public_host}:{state.kv_port}", model=c.served_model_name,
        block_size=state.block_size, kv_capacity_tokens=state.kv_capacity_tokens, started_at=time.time(),
        chunk_tokens=c.max_num_batched_tokens,
    )
    # The registry (etcd, or the conductor) may not be up yet: keep trying, 0.2 s to 5 s apart;
    # but not when it refuses our credentials, which /health then says (_registration_ended).
    await retrying(0.2, 5.0, RegistryUnavailable, final=RegistryRefused)(registry.register, info,
                                                                         ttl_s=c.registry_ttl_s)
    log.info("registered %s at %s", c.instance_id, c.registry_url)


async def drain_worker(state: WorkerState) -> None:
    """SIGTERM (mooncake/drain.py): leave routing, then wait for the requests in flight."""
    state.drain.begin(time.monotonic())
    log.info("draining %s: %d requests in flight, waiting up to %.0f s", state.config.instance_id,
             len(state.in_flight), state.config.drain_timeout_s)
    if state.register_task is not None:
        state.register_task.cancel()  # still retrying a first registration: never complete it
    if state.registry is not None:
        try:  # every conductor's watch drops this instance now, not at its lease's end
            await asyncio.wait_for(state.registry.deregister(state.config.instance_id), 5.0)
        except Exception as exc:  # noqa: BLE001 - /health already says draining; the lease expires anyway
            log.warning("deregistering %s failed: %r", state.config.instance_id, exc)
    left = await wait_idle(lambda: len(state.in_flight), state.config.drain_timeout_s)
    if left:
        log.warning("drain grace of %.0f s over with %d requests in flight", state.config.drain_timeout_s, left)
    else:
        log.info("drained %s", state.config.instance_id)


async def _close_registry(state: WorkerState) -> None:
    try:
        await state.registry.deregister(state.config.instance_id)
    except Exception:  # noqa: BLE001 - best effort on the way out; the lease expires anyway
        pass
    await state.registry.close()
