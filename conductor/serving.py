"""Serving one OpenAI request: validate, tokenize, route, relay, detokenize, answer.

Everything that can be refused is refused before any worker is touched, so a bad request costs
nothing and loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from conductor import responses
from conductor.config import ConductorConfig
from conductor.errors import APIError, sse_error
from conductor.lifecycle import LifeStreamingResponse, RequestLife
from conductor.metrics import DEFAULT_SLO_CLASS, ConductorMetrics
from conductor.relay import Relay, RelayStats
from conductor.routing import Router
from conductor.schemas import ChatCompletionRequest, CompletionRequest
from conductor.textstream import IncrementalDetokenizer, StopStringMatcher
from conductor.workers import WorkerError
from mooncake.protocol import GenerateChunk, Sampling

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    request_id: str
    prompt: list[int]
    sampling: Sampling
    stops: list[str]
    meta: responses.ResponseMeta
    stream: bool
    include_usage: bool
    arrived: float


class CompletionService:
    def __init__(self, config: ConductorConfig, tokenizer, router: Router, relay: Relay,
                 metrics: ConductorMetrics, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.relay = relay
        self.metrics = metrics
        self.clock = clock
        self.live: dict[str, RequestLife] = {}  # admitted and not released, by request id

    # -- validation -----------------------------------------------------------------------------

    async def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> Prepared:
        arrived = self.clock()
        chat = isinstance(body, ChatCompletionRequest)
        if body.model != self.config.served_model_name:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves "
                                f"`{self.config.served_model_name}`.", param="model", code="model_not_found")
        unknown = body.unknown_fields()
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        unsupported = body.unsupported_option()
        if unsupported is not None:
            field_name, message = unsupported
            raise APIError(400, message, param=field_name, code="unsupported_option")
        if not chat and (body.echo or body.suffix):
            raise APIError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompt = await asyncio.to_thread(self._tokenize, body)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        logit_bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
        if any(not 0 <= t < vocab for t, _ in logit_bias):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        limit = self.config.max_model_len
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        if len(prompt) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"prompt has {len(prompt)} tokens.", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        max_tokens = max_tokens or limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                                f"{max_tokens} for the completion).", param="max_tokens",
                           code="context_length_exceeded")
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, min_p=body.min_p or 0.0, seed=body.seed,
            min_tokens=min(body.min_tokens, max_tokens),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty or 1.0,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            logit_bias=logit_bias,
        )
        request_id = uuid.uuid4().hex
        return Prepared(
            request_id=request_id, prompt=prompt, sampling=sampling, stops=body.stop_strings(),
            meta=responses.ResponseMeta.new(request_id, body.model, chat), stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage), arrived=arrived,
        )

    def _tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from exc
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            if len(prompt) != 1:
                raise APIError(400, "batched prompts are not supported; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    # -- execution ------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.live)

    def snapshot(self) -> dict:
        """What admitted requests hold right now: after every request has ended, all zero."""
        ledgers = {h.name: {"prefill_jobs": len(h.ledger.prefill_jobs), "incoming": len(h.ledger.incoming),
                            "running": len(h.ledger.running)} for h in self.router.pool.all()}
        return {"in_flight": self.in_flight, "pending_prefix_entries": len(self.router.pending),
                "ledgers": ledgers}

    def admit(self, req: Prepared, endpoint: str) -> RequestLife:
        """Route the request and take its slot; refusals (429, 503) are counted and raised."""
        try:
            if self.in_flight >= self.config.max_in_flight:
                self.metrics.rejections.labels(reason="max_in_flight").inc()
                raise APIError(429, f"{self.in_flight} requests are in progress (limit "
                                    f"{self.config.max_in_flight}); retry shortly",
                               code="overloaded", headers={"Retry-After": "1"})
            with self.metrics.schedule.time():
                route = self.router.pick(req.request_id, req.prompt, req.sampling.max_tokens, self.clock())
        except APIError as exc:
            self.metrics.requests.labels(endpoint=endpoint, status=str(exc.status)).inc()
            self.metrics.count_slo(DEFAULT_SLO_CLASS, "refused")  # 429 or 503: refused before any work
            raise
        return RequestLife(req.request_id, endpoint, req.arrived, route, self.router, self.metrics, self.live,
                           self.clock)

    async def serve(self, req: Prepared, endpoint: str):
        life = self.admit(req, endpoint)
        handed_on = False
        try:
            stats = life.stats = RelayStats()
            first = await self._start(req, life, stats)
            first_at = life.first_token()
            route = life.route
            self.metrics.prompt_tokens.inc(len(req.prompt))
            self.metrics.cached_prompt_tokens.inc(stats.prefill_cached_tokens)
            headers = {"x-mooncake-prefill": route.prefill.name, "x-mooncake-decode": route.decode.name,
                       "x-mooncake-cached-tokens": str(stats.prefill_cached_tokens)}
            if route.decision is not None:
                headers["x-mooncake-predicted-ttft-ms"] = str(round(route.decision.predicted_ttft_s * 1000))
            events = self._events(req, life, first, first_at)
            if req.stream:
                response = LifeStreamingResponse(self._sse(req, life, events, stats), life,
                                                 media_type="text/event-stream", headers=headers)
                handed_on = True  # the response releases the life when it ends, however it ends
                return response
            try:
                text, finish, n_tokens = "", "length", 0
                async for piece, finish_reason, count in events:
                    text += piece
                    finish = finish_reason or finish
                    n_tokens = count
            except WorkerError as exc:
                raise APIError(502, f"a worker failed mid-request: {exc}") from exc
            headers["x-mooncake-decode-instance"] = stats.decode_instance
            headers["x-mooncake-decode-cached-tokens"] = str(stats.decode_cached_tokens or 0)
            usage = responses.usage(len(req.prompt), n_tokens, stats.prefill_cached_tokens)
            life.status = "200"
            return JSONResponse(responses.full_response(req.meta, text, finish, usage), headers=headers)
        except APIError as exc:
            life.status = str(exc.status)
            raise
        except Exception:
            life.status = "500"
            raise
        finally:
            if not handed_on:
                await life.release()

    async def _start(self, req: Prepared, life: RequestLife, stats: RelayStats) -> GenerateChunk:
        """Run until the first token, so a failure before it is still an honest HTTP error.
        A prefill that fails is retried once per other instance, moving the life to the new route."""
        tried: set[str] = set()
        while True:
            route = life.route
            life.chunks = self.relay.run(req.request_id, req.prompt, req.sampling, route, stats)
            try:
                return await life.chunks.__anext__()
            except WorkerError as exc:
                chunks, life.chunks = life.chunks, None
                await chunks.aclose()
                tried.add(route.prefill.name)
                life.leave_route()
                retry = self.router.pick(req.request_id, req.prompt, req.sampling.max_tokens, self.clock(),
                                         exclude=tried, allow_none=True)
                if retry is None:
                    raise APIError(503, f"no worker could run the prompt: {exc}", code="workers_unavailable",
                                   headers={"Retry-After": "5"}) from exc
                log.warning("prefill on %s failed (%s); retrying on %s", route.prefill.name, exc, retry.prefill.name)
                self.metrics.retries.labels(stage="prefill").inc()
                life.reroute(retry)

    async def _events(self, req: Prepared, life: RequestLife, first: GenerateChunk,
                      first_at: float) -> AsyncIterator[tuple[str, str | None, int]]:
        """(text, finish_reason, tokens so far), with stop strings applied. Ends early on a stop;
        the life closes the workers' stream (aborting them) when it is released."""
        detok = IncrementalDetokenizer(self.tokenizer)
        stopper = StopStringMatcher(req.stops)
        count = 0
        last = first_at
        chunk: GenerateChunk | None = first
        while chunk is not None:
            count += len(chunk.token_ids)
            self.metrics.generated_tokens.inc(len(chunk.token_ids))
            now = self.clock()
            if chunk is not first:
                self.metrics.tbt.observe(now - last)
            last = now
            life.relayed(count, now)
            result = stopper.push(detok.push(chunk.token_ids))
            if result.stopped:
                yield result.text, "stop", count
                return
            if chunk.finish_reason is not None:
                tail = stopper.push(detok.flush())
                yield result.text + tail.text + ("" if tail.stopped else stopper.flush()), \
                    "stop" if tail.stopped else chunk.finish_reason, count
                return
            if result.text:
                yield result.text, None, count
            chunk = await anext(life.chunks, None)
        yield stopper.flush(), "stop", count  # the stream ended without a finish reason

    async def _sse(self, req: Prepared, life: RequestLife, events, stats: RelayStats) -> AsyncIterator[str]:
        yield responses.chunk(req.meta, "", role=True) if req.meta.chat else ""
        n_tokens, status = 0, "200"
        try:
            async for text, finish, count in events:
                n_tokens = count
                if text or finish:
                    yield responses.chunk(req.meta, text, finish_reason=finish)
        except WorkerError as exc:
            status = "502"
            yield sse_error(APIError(502, f"a worker failed mid-stream: {exc}", code="worker_failed"))
        if req.include_usage:
            usage = responses.usage(len(req.prompt), n_tokens, stats.prefill_cached_tokens)
            yield responses.chunk(req.meta, None, usage_body=usage, no_choices=True)
        yield responses.DONE
        life.status = status  # every byte was handed to the server; a client gone before stays None
