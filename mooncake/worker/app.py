"""The worker's internal HTTP API (used by the conductor only).

  POST /internal/generate   GenerateRequest JSON -> NDJSON stream of GenerateChunk
  POST /internal/abort      {"request_id": ...}
  GET  /health              200 when the engine is ready, 503 while it starts or after it died
  GET  /internal/load       what is queued and running here (for routing)
  GET  /internal/kv_stats   the KV connector's counters
  GET  /metrics             Prometheus text

The HTTP server is up at once; the engine starts in the background (about 30 s on CPU), and
/health says 503 until it is ready, so a supervisor can tell "starting" from "dead".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from messenger.tcp import TcpClient, TcpConfig, TransferError
from mooncake.protocol import GenerateChunk, GenerateRequest
from mooncake.worker.config import WorkerConfig
from mooncake.worker.engine import build_engine, run_request
from mooncake.worker.metrics import WorkerMetrics

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
    engine: object | None = None
    engine_error: str | None = None
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics)

    def load(self) -> dict:
        queued = sum(r.prompt_tokens for r in self.in_flight.values() if r.first_token_at is None)
        return {
            "instance_id": self.config.instance_id,
            "role": self.config.role,
            "running_requests": len(self.in_flight),
            "queued_prefill_tokens": queued,
            "kv_tokens_used": sum(r.prompt_tokens for r in self.in_flight.values()),
        }


def create_app(config: WorkerConfig, kv_port: int) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state: WorkerState = app.state.worker
        starter = asyncio.create_task(_start_engine(state))
        yield
        starter.cancel()
        engine = state.engine
        if engine is not None:
            engine.shutdown()

    app = FastAPI(title=f"mooncake {config.role} worker", lifespan=lifespan)
    app.state.worker = WorkerState(config=config, kv_port=kv_port)

    @app.get("/health")
    async def health(request: Request):
        state: WorkerState = request.app.state.worker
        body = {"instance_id": config.instance_id, "role": config.role, "model": config.served_model_name,
                "kv_address": f"{config.public_host}:{state.kv_port}"}
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

    @app.get("/internal/kv_stats")
    async def kv_stats(request: Request):
        return await asyncio.to_thread(_connector_stats, request.app.state.worker.kv_port)

    @app.get("/metrics")
    async def metrics(request: Request):
        state: WorkerState = request.app.state.worker
        stats = await asyncio.to_thread(_connector_stats, state.kv_port)
        body = state.metrics.render(state.load(), stats.get("stats", {}))
        return StreamingResponse(iter([body]), media_type="text/plain; version=0.0.4")

    @app.post("/internal/abort")
    async def abort(request: Request):
        state: WorkerState = request.app.state.worker
        body = await request.json()
        if state.engine is not None:
            await state.engine.abort(str(body["request_id"]))
        return {"ok": True}

    @app.post("/internal/kv_drop")
    async def kv_drop(request: Request):
        body = await request.json()
        state: WorkerState = request.app.state.worker
        await asyncio.to_thread(_connector_call, state.kv_port, {"op": "drop", "transfer_id": str(body["transfer_id"])})
        return {"ok": True}

    @app.post("/internal/generate")
    async def generate(request: Request):
        state: WorkerState = request.app.state.worker
        if state.engine is None:
            return JSONResponse({"error": "engine is not ready"}, status_code=503)
        try:
            gen = GenerateRequest.from_dict(await request.json())
        except (KeyError, TypeError, ValueError) as exc:
            return JSONResponse({"error": f"bad generate request: {exc}"}, status_code=400)
        return StreamingResponse(_stream(state, gen), media_type="application/x-ndjson")

    return app


async def _stream(state: WorkerState, gen: GenerateRequest):
    entry = InFlight(prompt_tokens=len(gen.prompt_token_ids), started_at=time.monotonic())
    state.in_flight[gen.request_id] = entry
    outcome = "error"
    try:
        async for chunk in run_request(state.engine, gen):
            if entry.first_token_at is None and chunk.token_ids:
                entry.first_token_at = time.monotonic()
                state.metrics.observe_first_token(entry.first_token_at - entry.started_at)
            state.metrics.generated_tokens += len(chunk.token_ids)
            yield json.dumps(chunk.to_dict()) + "\n"
        outcome = "ok"
    except asyncio.CancelledError:
        outcome = "cancelled"  # the conductor went away; vLLM aborts the request itself
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the conductor as a final line
        log.exception("request %s failed", gen.request_id)
        yield json.dumps(GenerateChunk([], finish_reason="error", error=str(exc)).to_dict()) + "\n"
    finally:
        state.in_flight.pop(gen.request_id, None)
        state.metrics.prompt_tokens += entry.prompt_tokens
        state.metrics.requests[outcome] = state.metrics.requests.get(outcome, 0) + 1


async def _start_engine(state: WorkerState) -> None:
    try:
        # Building the engine blocks for tens of seconds; keep the event loop (and /health) free.
        state.engine = await asyncio.to_thread(build_engine, state.config, state.kv_port)
        log.info("%s worker %s ready", state.config.role, state.config.instance_id)
    except Exception as exc:  # noqa: BLE001 - surfaced by /health
        log.exception("engine failed to start")
        state.engine_error = f"{type(exc).__name__}: {exc}"


def _connector_stats(kv_port: int) -> dict:
    return _connector_call(kv_port, {"op": "stats"})


def _connector_call(kv_port: int, header: dict) -> dict:
    """Ask this worker's own connector (it lives in a vLLM process, reachable on the KV port)."""
    client = TcpClient(TcpConfig(connect_timeout_s=1.0, io_timeout_s=2.0))
    try:
        return client.request(f"127.0.0.1:{kv_port}", header)
    except TransferError as exc:
        return {"ok": False, "error": str(exc), "stats": {}}
    finally:
        client.close()
