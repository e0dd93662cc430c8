"""Serving one OpenAI request: validate, tokenize, route, relay, detokenize, answer.

Everything that can be refused is refused before any worker is touched, so a bad request costs
nothing and loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace

from fastapi.responses import JSONResponse

from conductor import responses
from conductor.choices import Choice, ChoiceEvent, Echo, LogprobsWanted
from conductor.config import ConductorConfig
from conductor.errors import APIError, sse_error
from conductor.lifecycle import LifeStreamingResponse, RequestLife
from conductor.metrics import ConductorMetrics
from conductor.merge import merged
from conductor.prompts import chat_prompt_ids, completion_prompt_ids
from conductor.relay import Relay, RelayStats, sample_zero
from conductor.routing import Router
from conductor.schemas import COMPLETION_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from conductor.logprobs import TokenText, prompt_logprobs_body
from conductor.slo import RequestSLO, SLOError, SLOPolicy
from conductor.workers import EngineFailed, RequestRefused, WorkerError
from mooncake.protocol import GenerateChunk, Sampling

log = logging.getLogger(__name__)
# The SLOs a retried request is routed with: none to speak of. It was admitted by its own once,
# and refusing it now would lose it (a prefill worker died; the other one is busy decoding).
RETRY_SLO_S = 1e6


def retry_slo(slo: RequestSLO, config) -> RequestSLO:
    """What an admitted request is routed again with: no SLOs to speak of, at a priority no class
    caps (admission.limits_for caps a less important request below the SLOs of the classes above
    it, which would refuse it after all), so it goes wherever it fits rather than be lost. Its
    class, and the priority vLLM runs it at, stay its own."""
    top = min([0, *(c.priority for c in config.slo_classes)])
    return replace(slo, priority=min(slo.priority, top), ttft_s=RETRY_SLO_S, tbt_s=RETRY_SLO_S)


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
    slo: RequestSLO
    continuous_usage: bool = False
    n: int = 1
    logprobs: LogprobsWanted | None = None
    echo: Echo | None = None
    prompt_logprobs: bool = False  # answer with vLLM's prompt_logprobs field


@dataclass
class Started:
    """An admitted request past its first token, and what answering it needs."""
    life: RequestLife
    stats: RelayStats
    headers: dict[str, str]
    choices: list[Choice]
    prompt_positions: list  # the prompt's logprobs, as the chunks bring them
    events: AsyncIterator[ChoiceEvent]


class ServerClosing(Exception):
    """The server is shutting down with this answer unfinished (CompletionService.closing)."""


def ends_at_prefill(req: Prepared) -> bool:
    """No decode batch takes the request: its answer is the prefill worker's one token
    (Sampling.ends_at_prefill), and it has no other samples, which start on the decode worker."""
    return req.n == 1 and req.sampling.ends_at_prefill()


def shutdown_error() -> APIError:
    return APIError(503, "the server is shutting down before this answer was finished; send the request again",
                    code="server_shutting_down")


def engine_failed(exc: EngineFailed) -> APIError:
    return APIError(500, f"the engine failed the request: {exc}", code="engine_error")


class CompletionService:
    def __init__(self, config: ConductorConfig, tokenizer, router: Router, relay: Relay,
                 metrics: ConductorMetrics, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.tokenizer = tokenizer
        self.router = router
        self.relay = relay
        self.metrics = metrics
        self.clock = clock
        self.token_text = TokenText(tokenizer)
        self.live: dict[str, RequestLife] = {}  # admitted and not released, by request id
        # Set when the server shuts down with answers unfinished (Ctrl-C, a drain's grace over): each
        # ends at its next token with an error, not cut off mid-stream by uvicorn looking whole.
        # A plain flag: the signal handler sets it, the event loop reads it between tokens.
        self.closing = False
        self.slo_policy = SLOPolicy.of(router.scheduler.config, config.slo_bounds)  # the classes the core admits by

    # -- validation -----------------------------------------------------------------------------

    async def prepare(self, body: CompletionRequest | ChatCompletionRequest,
                      headers: Mapping[str, str] | None = None) -> Prepared:
        """headers: the HTTP request's (its SLO class, priority and SLOs: conductor/slo.py)."""
        arrived = self.clock()
        chat = isinstance(body, ChatCompletionRequest)
        if body.model != self.config.served_model_name:
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves "
                                f"`{self.config.served_model_name}`.", param="model", code="model_not_found")
        own = body.mooncake_slo
        try:
            slo = self.slo_policy.resolve(headers or {}, body.priority, own.ttft_ms if own else None,
                                          own.tbt_ms if own else None)
        except SLOError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
        unknown = body.unknown_fields()
        if unknown:
            log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
        unsupported = body.unsupported_option()
        if unsupported is not None:
            field_name, message = unsupported
            raise APIError(400, message, param=field_name, code="unsupported_option")
        if chat and body.top_logprobs and not body.logprobs:
            raise APIError(400, "when using top_logprobs, logprobs must be set to true", param="top_logprobs",
                           code="invalid_value")
        try:
            structured = body.structured()
        except ValueError as exc:
            field_name = str(exc).split(":", 1)[0]
            raise APIError(400, str(exc), param=field_name, code="invalid_value") from exc
        if structured is not None and structured[0] == "choice":
            unwritable = await asyncio.to_thread(self._unwritable, json.loads(structured[1]))
            if unwritable is not None:  # the grammar could not be met: vLLM's engine fails it (a 500)
                raise APIError(400, f"the choice {unwritable!r} cannot be written with this model's tokens",
                               param="guided_choice" if body.guided_choice else "structured_outputs",
                               code="invalid_value")
        prompt = await asyncio.to_thread(self._tokenize, body)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        logit_bias = tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))
        if any(not 0 <= t < vocab for t, _ in logit_bias):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if any(t >= vocab for t in body.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        limit = self.config.max_model_len
        max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
        # The field the client set names a completion too long (chat: max_completion_tokens wins).
        max_tokens_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        if len(prompt) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                                f"prompt has {len(prompt)} tokens.", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:  # an explicit null: vLLM's (and OpenAI's) 16 for completions, the room left for chat
            max_tokens = limit - len(prompt) if chat else COMPLETION_DEFAULT_MAX_TOKENS
        echo_only = max_tokens == 0  # completions only (chat's is >= 1 by its schema)
        if echo_only and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt and its logprobs "
                                "alone)", param="max_tokens", code="invalid_value")
        if body.min_tokens > max_tokens:  # as vLLM's SamplingParams; a cut to the room left below still clamps it
            raise APIError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                                f"{body.min_tokens}.", param="min_tokens", code="invalid_value")
        if max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
                                f"{max_tokens} for the completion).", param=max_tokens_param,
                           code="context_length_exceeded")
        # As vLLM's server: a completion that fits the context by itself but not after this prompt
        # is cut to the room left (clients that always ask for a large max_tokens keep working as a
        # conversation grows); it ends with finish_reason "length".
        max_tokens = min(max_tokens, limit - len(prompt))
        sampling = Sampling(
            max_tokens=max(1, max_tokens),  # an echo alone still runs the prompt: its one token is dropped
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0, min_p=body.min_p or 0.0, seed=body.seed,
            min_tokens=min(body.min_tokens, max_tokens),
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty or 1.0,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            logit_bias=logit_bias, logprobs=body.logprobs_top(), prompt_logprobs=body.prompt_logprobs_top(),
            structured=structured,
        )
        request_id = uuid.uuid4().hex
        wanted = None if sampling.logprobs is None else LogprobsWanted(chat, sampling.logprobs, self.token_text)
        echo = None
        if not chat and body.echo:
            given = body.prompts()[0]
            text = given if isinstance(given, str) else await asyncio.to_thread(self.tokenizer.decode, prompt)
            echo = Echo(text, prompt, only=echo_only)
        return Prepared(
            request_id=request_id, prompt=prompt, sampling=sampling, stops=body.stop_strings(),
            meta=responses.ResponseMeta.new(request_id, body.model, chat), stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage), arrived=arrived,
            slo=slo,
            # as vLLM's: usage on every chunk only where the final usage chunk is asked for too
            continuous_usage=bool(body.stream_options and body.stream_options.include_usage
                                  and body.stream_options.continuous_usage_stats),
            n=body.n, logprobs=wanted, echo=echo, prompt_logprobs=body.prompt_logprobs is not None,
        )

    def _unwritable(self, texts: list[str]) -> str | None:
        """The first text the tokenizer cannot write exactly (None: it writes them all). A byte-level
        vocabulary may lack bytes that no text it learned had (those of unassigned Unicode planes),
        and writes U+FFFD instead. In a thread, as the prompt's tokenization: a long list takes a while."""
        tok = self.tokenizer
        return next((t for t in texts if tok.decode(tok.encode(t, add_special_tokens=False)) != t), None)

    def _tokenize(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            return chat_prompt_ids(self.tokenizer, body.messages, body.tools, body)
        prompts = body.prompts()
        if len(prompts) != 1:  # conductor/batch.py prepares a batch's prompts one by one
            raise ValueError(f"one prompt expected, not {len(prompts)}")
        return completion_prompt_ids(self.tokenizer, prompts[0], body.add_special_tokens)

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
                self.metrics.rejections.labels(reason="max_in_flight", slo_class=req.slo.slo_class).inc()
                raise APIError(429, f"{self.in_flight} requests are in progress (limit "
                                    f"{self.config.max_in_flight}); retry shortly",
                               code="overloaded", headers={"Retry-After": "1"})
            with self.metrics.schedule.time():
                route = self.router.pick(req.request_id, req.prompt, req.sampling.max_tokens, self.clock(),
                                         slo=req.slo, ends_at_prefill=ends_at_prefill(req))
        except APIError as exc:
            self.metrics.requests.labels(endpoint=endpoint, status=str(exc.status), slo_class=req.slo.slo_class).inc()
            self.metrics.count_slo(req.slo.slo_class, "refused")  # 429 or 503: refused before any work
            raise
        return RequestLife(req.request_id, endpoint, req.arrived, route, self.router, self.metrics, self.live,
                           self.clock, req.slo)

    async def serve(self, req: Prepared, endpoint: str):
        """Answer one prepared request: a streamed response (which then owns the request's life)
        or a whole body."""
        started = await self.start(req, self.admit(req, endpoint))
        if req.stream:
            return LifeStreamingResponse(self.sse([(req, started)]), [started.life],
                                         media_type="text/event-stream", headers=started.headers)
        try:
            body, headers = await self.whole(req, started)
            return JSONResponse(body, headers=headers)
        finally:
            await started.life.release()

    async def start(self, req: Prepared, life: RequestLife) -> Started:
        """Run an admitted request to its first token, so a failure before it is still an honest
        HTTP error. On success the caller owns `Started.life` and must release it; on any failure
        it is released here (a cancellation keeps the status the life had: None is 499)."""
        try:
            first = await self._start(req, life)
            stats = life.stats  # the attempt that reached the first token
            first_at = life.first_token()
            route = life.route
            self.metrics.prompt_tokens.inc(len(req.prompt))
            self.metrics.cached_prompt_tokens.inc(stats.prefill_cached_tokens)
            # Where the request ran, which a worker that failed before the first token changed.
            headers = {"x-mooncake-prefill": stats.prefill_instance or route.prefill.name,
                       "x-mooncake-decode": stats.decode_instance or route.decode.name,
                       "x-mooncake-cached-tokens": str(stats.prefill_cached_tokens),
                       "x-mooncake-slo-class": req.slo.slo_class}
            if route.decision is not None:
                headers["x-mooncake-predicted-ttft-ms"] = str(round(route.decision.predicted_ttft_s * 1000))
                if route.decision.best_effort:
                    headers["x-mooncake-best-effort"] = "true"
            choices = [Choice(i, self.tokenizer, req.stops, req.logprobs, req.echo, req.sampling.min_tokens)
                       for i in range(req.n)]
            prompt_positions: list = []
            events = self._events(req, life, first, first_at, choices, prompt_positions)
            return Started(life, stats, headers, choices, prompt_positions, events)
        except BaseException as exc:
            if isinstance(exc, APIError):
                life.status = str(exc.status)
            elif isinstance(exc, Exception):
                life.status = "500"
            await life.release()
            raise

    async def whole(self, req: Prepared, started: Started) -> tuple[dict, dict[str, str]]:
        """A started, non-streamed request's answer: (body, headers). Sets its life's status;
        the caller releases the life."""
        life, stats, headers, choices = started.life, started.stats, started.headers, started.choices
        try:
            try:
                async for _ in started.events:
                    pass
            except EngineFailed as exc:
                raise engine_failed(exc) from exc
            except WorkerError as exc:
                raise APIError(502, f"a worker failed mid-request: {exc}") from exc
            except ServerClosing:
                raise shutdown_error() from None
            headers["x-mooncake-decode-instance"] = stats.decode_instance
            headers["x-mooncake-decode-cached-tokens"] = str(stats.decode_cached_tokens or 0)
            if stats.sibling_cached_tokens:
                headers["x-mooncake-sibling-cached-tokens"] = ",".join(map(str, stats.sibling_cached_tokens))
            usage = responses.usage(len(req.prompt), sum(c.count for c in choices), stats.prefill_cached_tokens)
            prompt_positions = started.prompt_positions
            prompt_lp = prompt_logprobs_body(prompt_positions, self.token_text) if req.prompt_logprobs else None
            body = responses.full_response(
                req.meta, [responses.choice(req.meta, c.index, c.text, c.finish, c.logprobs, prompt_lp,
                                             c.stop_reason)
                           for c in choices], usage, prompt_lp)
            life.status = "200"
            return body, headers
        except APIError as exc:
            life.status = str(exc.status)
            raise
        except Exception:
            life.status = "500"
            raise

    async def _start(self, req: Prepared, life: RequestLife) -> tuple[int, GenerateChunk]:
        """Run until the first token, so a failure before it is still an honest HTTP error.
        A prefill that fails is retried once per other instance, moving the life to the new route.
        Each attempt has its own RelayStats (`life.stats`, the last one's): a shared one carried
        the failed attempt's figures (cached tokens, a measured prefill, `retried`) into the
        retry's, whose calibration samples then mixed two attempts' workers."""
        tried: set[str] = set()
        while True:
            route = life.route
            stats = life.stats = RelayStats()
            planned = {route.prefill.name, route.decode.name}  # the relay may move the route on
            # Each attempt has its own id, which names its KV transfer and its workers' requests:
            # the failed attempt's prefill may still reserve on the decode worker, and its drop
            # is sent after the retry started; under one id either would take the retry's KV.
            attempt_id = f"{req.request_id}-r{len(tried)}" if tried else req.request_id
            if req.n == 1:
                life.chunks = sample_zero(self.relay.run(attempt_id, req.prompt, req.sampling, route, stats))
            else:
                life.chunks = self.relay.samples(attempt_id, req.prompt, req.sampling, route, stats, req.n,
                                                 stopped=life.stopped_samples)
            try:
                return await life.chunks.__anext__()
            except RequestRefused as exc:  # the request itself is invalid: no other worker would take it
                chunks, life.chunks = life.chunks, None
                await chunks.aclose()
                raise APIError(400, f"the engine refused the request: {exc}", code="invalid_value") from exc
            except EngineFailed as exc:
                chunks, life.chunks = life.chunks, None
                await chunks.aclose()
                raise engine_failed(exc) from exc
            except WorkerError as exc:
                chunks, life.chunks = life.chunks, None
                await chunks.aclose()
                # The worker that failed: the prefill, or a decode worker that failed before its
                # first token with no other to take it (a grammar's request starts on D).
                failed = exc.worker if exc.worker in (route.prefill.name, route.decode.name) else route.prefill.name
                stage = "decode" if failed != route.prefill.name else "prefill"
                # The relay moves a decode that fails before its first token to another worker,
                # which may be one tried before: then the whole attempt failed, and its workers
                # are all left out, or two workers that both fail the request (an engine that
                # cannot take its parameters) would hand it back and forth for ever.
                excluded = len(tried)
                tried |= {failed} if failed not in tried else planned
                life.leave_route()
                if len(tried) == excluded:
                    raise APIError(502, f"the request failed on every worker that could take it; the last, "
                                        f"{failed}: {exc}", code="worker_failed") from exc
                try:
                    # Admitted already: its SLOs priced it once and do not refuse it now (a worker
                    # that is busy decoding takes it late rather than the request being lost).
                    retry = self.router.pick(req.request_id, req.prompt, req.sampling.max_tokens, self.clock(),
                                             exclude=tried, slo=retry_slo(req.slo, self.router.scheduler.config),
                                             ends_at_prefill=ends_at_prefill(req))
                except APIError as refused:  # no other worker is ready, or none has room for its KV
                    raise APIError(refused.status, f"{failed} failed before the first token ({exc}), "
                                                   f"and no other worker can take the request: {refused.message}",
                                   code=refused.code, headers=refused.headers) from exc
                log.warning("%s on %s failed (%s); retrying with prefill on %s, decode on %s", stage, failed, exc,
                            retry.prefill.name, retry.decode.name)
                self.metrics.retries.labels(stage=stage).inc()
                life.reroute(retry)

    async def _events(self, req: Prepared, life: RequestLife, first: tuple[int, GenerateChunk], first_at: float,
                      choices: list[Choice], prompt_positions: list) -> AsyncIterator[ChoiceEvent]:
        """Each choice's pieces (text cut at stop strings, logprobs), as the workers' chunks come.
        Ends when every choice has ended; the life closes the workers' streams (aborting what
        still runs, e.g. a choice cut at a stop string) when it is released."""
        # Each choice's last chunk time: a gap between tokens is within one sample (n > 1
        # interleaves the samples' chunks; their first chunks are no gap).
        last = {first[0]: first_at}
        item: tuple[int, GenerateChunk] | None = first
        while item is not None:
            index, chunk = item
            self.metrics.generated_tokens.inc(len(chunk.token_ids))
            now = self.clock()
            if item is not first and index in last:
                self.metrics.tbt.labels(slo_class=req.slo.slo_class).observe(now - last[index])
            last[index] = now
            prompt_positions.extend(chunk.prompt_logprobs or ())
            event = choices[index].push(chunk, prompt_positions)
            life.relayed(max(c.count for c in choices), now)  # n > 1: the longest choice's pace
            if event is not None:
                yield event
            if all(c.done for c in choices):
                return
            if choices[index].done:  # cut at a stop string: its worker need not go on
                life.stopped_samples.add(index)
            if self.closing:
                raise ServerClosing
            item = await anext(life.chunks, None)
        for choice in choices:  # the stream ended without a finish reason
            if not choice.done:
                yield choice.end()

    async def sse(self, parts: list[tuple[Prepared, Started]]) -> AsyncIterator[str]:
        """The event stream of started requests answered as one: a completions request's batched
        prompts (conductor/batch.py) or a single request. Prompt k's choice j is choice
        k * n + j, as vLLM numbers them; usage sums the prompts. Sets each life's status; the
        response that streams this releases the lives."""
        req, n = parts[0][0], parts[0][0].n
        if req.meta.chat:
            # As vLLM: with continuous usage the role chunks carry it too, nothing generated yet.
            opening = _choice_usage(parts[0], 0) if req.continuous_usage else None
            for i in range(n):
                yield responses.chunk(req.meta, "", role=True, index=i, usage_body=opening)
        else:
            yield ""  # the headers go out now, as the first token is known
        status = "200"
        try:
            # Closed here however this stream ends (a client that leaves closes it at a yield):
            # its reads of the other prompts' streams must stop before the lives close those.
            async with contextlib.aclosing(merged([started.events for _, started in parts])) as events:
                async for k, event in events:
                    # Continuous usage is the chunk's own choice's, as vLLM reports it: its prompt's
                    # tokens and the tokens of that choice so far (the sum over all choices and
                    # prompts made each choice's count jump by the others' tokens).
                    so_far = _choice_usage(parts[k], event.tokens) if req.continuous_usage else None
                    yield responses.chunk(req.meta, event.text, finish_reason=event.finish, index=k * n + event.index,
                                          logprobs=event.logprobs, usage_body=so_far, stop_reason=event.stop_reason)
        except EngineFailed as exc:
            status = "500"
            yield sse_error(engine_failed(exc))
        except WorkerError as exc:
            status = "502"
            yield sse_error(APIError(502, f"a worker failed mid-stream: {exc}", code="worker_failed"))
        except ServerClosing:
            status = "503"
            yield sse_error(shutdown_error())
        if req.include_usage:
            yield responses.chunk(req.meta, None, usage_body=_usage(parts), no_choices=True)
        yield responses.DONE
        for _, started in parts:  # every byte was handed to the server; a client gone before stays None
            started.life.status = status


def _choice_usage(part: tuple[Prepared, Started], tokens: int) -> dict:
    """One choice's usage so far: its prompt's tokens (cached ones too) and `tokens` generated."""
    req, started = part
    return responses.usage(len(req.prompt), tokens, started.stats.prefill_cached_tokens)


def _usage(parts: list[tuple[Prepared, Started]]) -> dict:
    return responses.usage(sum(len(req.prompt) for req, _ in parts),
                           sum(c.count for _, started in parts for c in started.choices),
                           sum(started.stats.prefill_cached_tokens for _, started in parts))
