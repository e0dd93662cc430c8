"""The conductor: the cluster's only public API (OpenAI-compatible), built by create_app(config)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
from collections.abc import Awaitable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conductor.auth import ApiKeyGuard, check_model_access, may_use
from conductor.batch import prepare_batch, serve_batch
from conductor.config import ConductorConfig, live_estimators, resolve_profile
from conductor.core.index import PrefixIndex
from conductor.core.scheduler import Scheduler
from conductor.errors import APIError, install_error_handlers
from conductor.membership import follow_registry, poll_health, poll_kv_events
from conductor.metrics import CONTENT_TYPE, ConductorMetrics, LiveState, RefusalCounter
from conductor.relay import Relay
from conductor.routing import Router
from conductor.prompts import detokenize_body, prefix_request_ids, tokenize_body, tokenize_request
from conductor.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from conductor.serving import CompletionService
from conductor.workers import WorkerClient, WorkerPool, can_serve
from mooncake.auth import ClusterTokenGuard, token_headers
from mooncake.body_limit import BodyLimitMiddleware
from mooncake.drain import Drain, wait_idle
from mooncake.registry import ClusterView, MemoryRegistry, RegistryConfig, ViewConfig, open_registry
from mooncake.registry.http import registry_router

log = logging.getLogger(__name__)


def create_app(config: ConductorConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from transformers import AutoTokenizer  # slow import; only the running server needs it

        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, config.model_path)
        pool, index = WorkerPool(), PrefixIndex()
        for url in (*config.prefill_urls, *config.decode_urls):
            pool.add(url, static=True)
        given_up = app.state.metrics.streams_given_up
        client = WorkerClient(token_timeout_s=config.token_timeout_s, cluster_token=config.cluster_token,
                              health_timeouts_tolerated=config.health_timeouts_tolerated,
                              on_streams_given_up=lambda name, n: given_up.labels(instance=name).inc(n))
        profile = resolve_profile(config.profile, config.dtype)
        log.info("pricing with profile table %s", profile)
        app.state.profile = profile
        scheduler = Scheduler(config.scheduler, live_estimators(profile))
        router = Router(pool, index, scheduler, app.state.metrics)
        relay = Relay(client, config.kv_wait_timeout_s,
                      pick_fallback=lambda tried: next(
                          (h for h in pool.all() if h.ready and h.name not in tried
                           # with flexible roles any worker may decode
                           and (config.scheduler.flexible_roles or h.serves("decode"))), None),
                      on_retry=lambda stage: app.state.metrics.retries.labels(stage=stage).inc(),
                      on_moved=lambda route, worker: router.move_decode(route, worker, service.clock()),
                      on_prefilled=lambda route: router.prefill_ended(route, service.clock()))
        app.state.pool, app.state.index, app.state.router = pool, index, router
        service = app.state.service = CompletionService(config, tokenizer, router, relay, app.state.metrics)
        app.state.metrics.watch(lambda: LiveState(
            in_flight=service.in_flight,
            ready_workers={"prefill": len(pool.ready("prefill")), "decode": len(pool.ready("decode"))},
            can_serve=can_serve(pool, config.scheduler.flexible_roles),
            push_bandwidth_Bps={h.name: h.push_bandwidth.estimate_Bps for h in pool.all()
                                if h.push_bandwidth.estimate_Bps},
            estimators=estimators_report(router),
            retry_backlog_s=router.retries.backlog_s(service.clock())))
        registry = app.state.registry if config.registry_url is None else followed_registry(config)
        view = ClusterView(ViewConfig(expire_after_s=2 * config.registry_ttl_s))
        tasks = [asyncio.create_task(poll_health(pool, client, index, config.health_interval_s)),
                 asyncio.create_task(poll_kv_events(pool, index, config.kv_events_interval_s,
                                                         token_headers(config.cluster_token))),
                 asyncio.create_task(follow_registry(registry, view, pool, index))]
        for task in tasks:  # each runs for the conductor's life: one that ends is said at once, loudly
            task.add_done_callback(_loop_ended)
        app.state.view = view
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await client.close()
            await registry.close()

    app = FastAPI(title="mooncake conductor", version=VERSION, lifespan=lifespan)
    app.state.config = config
    app.state.metrics = ConductorMetrics()
    app.state.started = int(time.time())
    app.state.drain = Drain()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    # Added last, so they run first: an unauthenticated request is refused before its body is read.
    app.add_middleware(ClusterTokenGuard, token=config.cluster_token)
    app.add_middleware(ApiKeyGuard, keys=config.api_keys)
    app.add_middleware(RefusalCounter, state=app.state)  # counts what the middleware and validation refuse
    if config.registry_url is None:
        # The embedded registry: workers on this machine register here over HTTP.
        app.state.registry = MemoryRegistry(RegistryConfig(url="memory://", ttl_s=config.registry_ttl_s))
        app.include_router(registry_router(app.state.registry))

    @app.get("/v1/models")
    async def models(request: Request):
        # A key limited to some models sees only those.
        visible = may_use(request, config.served_model_name)
        return {"object": "list", "data": [_model_card(config, app.state.started)] if visible else []}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_model_access(request, model_id)
        if model_id != config.served_model_name:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
        return _model_card(config, app.state.started)

    @app.post("/v1/completions", dependencies=[Depends(json_content_type)])
    async def completions(body: CompletionRequest, request: Request):
        service: CompletionService = request.app.state.service
        return await _serve(service, body, "completions", request)

    @app.post("/v1/chat/completions", dependencies=[Depends(json_content_type)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        service: CompletionService = request.app.state.service
        return await _serve(service, body, "chat", request)

    @app.get("/version")
    async def version():
        """vLLM's: the server's version (this package's; the engines' vLLM is on each worker)."""
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: the token ids a prompt or chat messages become (the chat template applied)."""
        body = tokenize_request(await _json_body(request))
        _check_tokenizer_model(request, config, body.model)
        tokenizer = request.app.state.service.tokenizer
        return await asyncio.to_thread(tokenize_body, tokenizer, body, config.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        _check_tokenizer_model(request, config, body.model)
        return await asyncio.to_thread(detokenize_body, request.app.state.service.tokenizer, body)

    @app.get("/health")
    async def health(request: Request):
        pool: WorkerPool = request.app.state.pool
        workers = [{"url": h.http_url, "instance_id": h.instance_id, "role": h.role, "status": h.status,
                    "error": h.last_error, "kv_push_bandwidth_Bps": h.push_bandwidth.estimate_Bps}
                   for h in pool.all()]
        ok = can_serve(pool, config.scheduler.flexible_roles)
        view = request.app.state.view
        draining = request.app.state.drain.active  # SIGTERM: a balancer takes this replica out
        ok = ok and not draining
        # Serving, but a worker it knows is down or not ready yet (a restart, a failed health poll).
        degraded = ok and not all(h.ready for h in pool.all())
        status = "draining" if draining else "degraded" if degraded else "ok" if ok else "unavailable"
        body = {"status": status, "ready": {"prefill": len(pool.ready("prefill")),
                "decode": len(pool.ready("decode"))}, "workers": workers,
                "registry": {"url": config.registry_url or "embedded", "instances": len(view),
                             "outage_since": view.outage_since},
                "prefix_index_blocks": len(request.app.state.index),
                # What admitted requests hold (in-flight slots, ledger entries per worker, pending
                # prefix entries): all zero once every request has ended, however it ended.
                "requests": request.app.state.service.snapshot()}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/internal/debug/estimators")
    async def debug_estimators(request: Request):
        """Each instance's prior and calibrated estimator coefficients, scales, samples, errors."""
        router: Router = request.app.state.router
        return {"profile": request.app.state.profile, "instances": estimators_report(router)}

    @app.post("/internal/debug/prefix")
    async def debug_prefix(request: Request):
        """Which instances hold a cached prefix of a prompt (the body is /tokenize's, or a prompt
        of token ids), as the router sees it in its prefix index."""
        data = await _json_body(request)
        ids = await asyncio.to_thread(prefix_request_ids, request.app.state.service.tokenizer, data)
        return request.app.state.router.where_cached(ids)

    return app


def json_content_type(request: Request) -> None:
    """Refuses a body declared as something other than JSON (curl -d sends a form's type): FastAPI
    would not parse it and the answer was a 400 about "a valid dictionary", which names neither the
    header nor the fix. vLLM refuses it too; 415 is HTTP's status for it. A body without a
    Content-Type is refused the same way: FastAPI (strict_content_type) does not read it as JSON.
    The types FastAPI parses pass: application/json and application/*+json."""
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    sent = f"not {media_type!r}" if media_type else "none was sent"
    raise APIError(415, f"Content-Type must be application/json ({sent})", code="unsupported_media_type")


async def _json_body(request: Request):
    try:
        return await request.json()
    except ValueError:
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    except RecursionError:  # json's parser recurses per level of nesting
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


async def drain_conductor(app: FastAPI) -> None:
    """SIGTERM (mooncake/drain.py): /health turns 503 while requests still reaching this replica
    are answered; returns when none is in flight, or when the grace period ends."""
    config: ConductorConfig = app.state.config
    app.state.drain.begin(time.monotonic())
    service = getattr(app.state, "service", None)  # None: SIGTERM before the lifespan started
    busy = (lambda: service.in_flight) if service is not None else (lambda: 0)
    log.info("draining: %d requests in flight, waiting up to %.0f s", busy(), config.drain_timeout_s)
    left = await wait_idle(busy, config.drain_timeout_s)
    if left:
        log.warning("drain grace of %.0f s over with %d requests in flight: ending them with an error",
                    config.drain_timeout_s, left)
        close_streams(app)


def close_streams(app: FastAPI) -> None:
    """The server is shutting down: answers in progress end at their next token with a 503 error
    (an error event in a stream), not cut off mid-stream. Safe in a signal handler: sets a flag."""
    service = getattr(app.state, "service", None)  # None: before the lifespan started
    if service is not None:
        service.closing = True


def followed_registry(config: ConductorConfig):
    """The registry this conductor follows (etcd, or another conductor's embedded one, which asks
    for the cluster token like every internal endpoint)."""
    return open_registry(RegistryConfig(url=config.registry_url, ttl_s=config.registry_ttl_s,
                                        cluster_token=config.cluster_token,
                                        etcd_credentials=config.etcd_credentials))


def estimators_report(router: Router) -> dict:
    """Calibration.describe() of the instances still in the pool."""
    router.forget_departed()
    return router.calibration.describe()



async def _serve(service: CompletionService, body, endpoint: str, request: Request):
    request.state.served = True  # counted here from now on, not by RefusalCounter
    batch = isinstance(body, CompletionRequest) and len(body.prompts()) > 1
    try:
        check_model_access(request, body.model)
        prepared = await (prepare_batch(service, body, request.headers) if batch
                          else service.prepare(body, request.headers))
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else _internal_error(exc, "preparing")
        service.metrics.requests.labels(endpoint=endpoint, status=str(error.status),
                                        slo_class=service.slo_policy.label(request.headers)).inc()
        if error is exc:
            raise
        raise error from exc
    try:
        # Each counts its own answer, refusals included.
        serving = serve_batch(service, prepared, endpoint) if batch else service.serve(prepared, endpoint)
        # Until its first token a streamed answer is no response yet, so nothing else would
        # notice the client leaving; after it, the streaming response notices by itself.
        return await _unless_client_leaves(request, serving)
    except APIError:
        raise
    except Exception as exc:
        raise _internal_error(exc, "serving") from exc


def _package_version() -> str:
    try:
        return importlib.metadata.version("mooncake-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


VERSION = _package_version()


def _check_tokenizer_model(request: Request, config: ConductorConfig, model: str | None) -> None:
    """/tokenize and /detokenize name the model optionally, as vLLM's do."""
    if model is None:
        return
    check_model_access(request, model)
    if model != config.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves "
                            f"`{config.served_model_name}`.", param="model", code="model_not_found")


def _internal_error(exc: Exception, doing: str) -> APIError:
    """A bug, answered as OpenAI's error JSON (not Starlette's plain text, which also drops the
    client's connection), with the traceback in the log."""
    log.error("%s a request failed", doing, exc_info=exc)
    return APIError(500, f"internal error while {doing} the request ({type(exc).__name__}: {exc}); the "
                         f"conductor's log has the traceback", code="internal_error")


async def _unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """uvicorn does not cancel a handler whose client disconnected, so a non-streamed answer
    would keep its workers generating for nobody until the end, and a streamed one until its
    first token (up to a long prefill). Race it against the client's disconnect and cancel it
    then (its RequestLife releases everything and aborts the workers)."""
    task = asyncio.ensure_future(work)

    async def client_left() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("client left before the answer (or a stream's first token); its work was cancelled")
    return Response(status_code=499)  # nobody reads it


def _loop_ended(task: asyncio.Task) -> None:
    """A background loop (health polls, KV events, registry) ended before shutdown: its exception
    would otherwise be read only at exit, while the cluster view silently went stale."""
    if task.cancelled():
        return
    exc = task.exception()
    log.critical("background loop %s ended%s; the conductor's view of its workers is no longer kept up to "
                 "date: restart it", task.get_coro().__qualname__, f": {exc!r}" if exc else "")


def _model_card(config: ConductorConfig, created: int) -> dict:
    return {"id": config.served_model_name, "object": "model", "created": created, "owned_by": "mooncake",
            "root": config.model_path, "parent": None, "max_model_len": config.max_model_len}

