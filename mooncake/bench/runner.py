"""The shell of `mooncake bench`: sends a run's requests on schedule and records what came back.

Open loop: each request is sent at its scheduled time whatever the server is doing, as real
users would (a closed loop would slow down with the server and hide its queueing). Everything
measured is client-side, with one monotonic clock, from the first attempt's send.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import openai
from openai import AsyncOpenAI
from tqdm import tqdm

from mooncake.bench.stats import ERROR, OK, REFUSED, RequestRecord

PREDICTED_TTFT_HEADER = "x-mooncake-predicted-ttft-ms"
MAX_ATTEMPTS = 100
"""Most sends of one request under --retry-after: a server answering 429 with Retry-After: 0
at once is not asked thousands of times within --max-retry-wait."""


class EndpointError(RuntimeError):
    """The endpoint is down, refuses, or does not serve the model: nothing was measured."""


@dataclass(frozen=True, slots=True)
class ClientOptions:
    base_url: str
    """The /v1 URL."""
    model: str
    api_key: str = "EMPTY"
    temperature: float = 0.0
    ignore_eos: bool = True
    """Ask the server to ignore EOS (vLLM's extra field) so every output is max_tokens long."""
    retry_after: bool = False
    """Honour the Retry-After of a 429 (or of a 503 that has one); otherwise such an answer is a refusal."""
    max_retry_wait_s: float = 30.0
    """The most time from a request's first send to a retry's send, 429 answers and waits alike
    (a Retry-After that would pass it is a refusal)."""
    request_timeout_s: float = 600.0


def make_client(opts: ClientOptions) -> AsyncOpenAI:
    # max_retries=0: the library's own retries would hide refusals and errors from the figures.
    # No connection limit: the SDK's pool holds 1,000, and a request past that (an overload sweep)
    # waited here for a connection, after its send time, and the wait counted as the server's TTFT.
    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=100))
    return AsyncOpenAI(base_url=opts.base_url, api_key=opts.api_key, max_retries=0, timeout=opts.request_timeout_s,
                       http_client=http)


PREFLIGHT_TIMEOUT_S = 15.0  # a listing of models takes milliseconds; a frozen server must not take --request-timeout


async def preflight(client: AsyncOpenAI, model: str | None) -> tuple[str, int | None]:
    """GET /v1/models once: the endpoint answers, and serves `model` (None: its first model).
    Returns the model and its context length when the listing says (vLLM's and our conductor's
    max_model_len). Raises EndpointError with what to fix."""
    timeout = min(PREFLIGHT_TIMEOUT_S, client.timeout if isinstance(client.timeout, (int, float)) else PREFLIGHT_TIMEOUT_S)
    try:
        # Read as raw JSON: the SDK's parser fails with an AttributeError on a body that is not a
        # model list (a web page at the wrong URL answers 200 too).
        raw = await client.with_options(timeout=timeout).models.with_raw_response.list()
    except openai.APITimeoutError:
        raise EndpointError(f"{client.base_url}models gave no answer within {timeout:g} s; is the server "
                            f"frozen or overloaded?") from None
    except openai.APIConnectionError as exc:
        raise EndpointError(f"cannot reach {client.base_url}: {exc.__cause__ or exc}; is the server running?") from None
    except openai.APIStatusError as exc:
        raise EndpointError(f"{client.base_url}models answered HTTP {exc.status_code}: {exc.message}") from None
    models = model_ids(raw.http_response)
    contexts = model_contexts(raw.http_response)
    if models is None:
        content_type = raw.http_response.headers.get("content-type", "no content type")
        raise EndpointError(f"{client.base_url}models answered HTTP {raw.http_response.status_code} ({content_type}) "
                            f"but not an OpenAI model list; is --url the endpoint's /v1 URL?")
    if not models:
        raise EndpointError(f"{client.base_url}models lists no model")
    if model is None:
        return models[0], contexts.get(models[0])
    if model not in models:
        raise EndpointError(f"the endpoint does not serve model {model!r}; it serves {', '.join(models)}")
    return model, contexts.get(model)


def model_ids(response) -> list[str] | None:
    """The ids of a /models answer ({"data": [{"id": ...}, ...]}); None when it is not one."""
    try:
        doc = response.json()
    except (ValueError, RecursionError):  # not JSON (or not UTF-8, or nested past the parser's depth)
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        return None
    return [m["id"] for m in data]


def model_contexts(response) -> dict[str, int]:
    """Model id -> max_model_len, for the models of a /models answer that say it."""
    try:
        data = response.json().get("data")
        return {m["id"]: m["max_model_len"] for m in data
                if type(m.get("max_model_len")) is int and m["max_model_len"] > 0 and isinstance(m.get("id"), str)}
    except (ValueError, RecursionError, AttributeError, TypeError):
        return {}


def retry_after_s(headers) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date); None if absent or bad."""
    value = headers.get("retry-after") if headers is not None else None
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        # A negative or nan delay is no instruction (the standard allows non-negative integers only).
        return seconds if 0 <= seconds < math.inf else None
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def predicted_ttft_s(headers) -> float | None:
    """The TTFT the server's scheduler predicted (our conductor's x-mooncake-predicted-ttft-ms);
    None from a server that does not say."""
    value = headers.get(PREDICTED_TTFT_HEADER) if headers is not None else None
    try:
        ms = float(value) if value else math.nan
    except ValueError:
        return None
    return ms / 1000 if math.isfinite(ms) and ms >= 0 else None  # a NaN would make the rate's ratio NaN


class AnswerError(Exception):
    """A stream that ended without error from the HTTP library but is not a whole answer."""


async def send_one(client: AsyncOpenAI, opts: ClientOptions, prompt: str | list[int], rec: RequestRecord,
                   t0: float) -> None:
    """Send one request (retrying after 429 if asked) and fill `rec`; never raises."""
    now = lambda: time.perf_counter() - t0  # noqa: E731
    rec.sent_s = now()
    # A token-id prompt goes in extra_body, which the SDK sends as given: its own argument is walked
    # element by element (0.3 s for 30k tokens here), on this event loop and inside the latency.
    extra = {"ignore_eos": True} if opts.ignore_eos else {}
    if not isinstance(prompt, str):
        extra["prompt"] = prompt
    while True:
        rec.attempts += 1
        try:
            async with asyncio.timeout(opts.request_timeout_s):  # the whole answer, not each read
                raw = await client.completions.with_raw_response.create(
                    model=opts.model, prompt=prompt if isinstance(prompt, str) else "", max_tokens=rec.max_tokens,
                    temperature=opts.temperature, stream=True, stream_options={"include_usage": True},
                    extra_body=extra or None)
                rec.predicted_ttft_s = predicted_ttft_s(raw.headers)
                stream = raw.parse()
                token_chunks, usage_tokens, stream_error, finished = 0, None, None, False
                async for chunk in stream:
                    # vLLM's error shape (the SDK raises only for {"error": {...}}). Read on to the
                    # end, which follows at once: raising here would leave the SDK's generators
                    # open, and asyncio logs a traceback closing them.
                    if getattr(chunk, "object", None) == "error":
                        stream_error = stream_error or getattr(chunk, "message", None) or "no message"
                    if stream_error is not None:
                        continue
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
                    # A token: text, or none yet (one that ends inside a multi-byte character);
                    # not an empty last chunk that only brings the finish reason.
                    choice = chunk.choices[0] if chunk.choices else None
                    if choice is not None and (choice.text or (choice.text is not None and not choice.finish_reason)):
                        t = now()
                        if rec.first_token_s is None:
                            rec.first_token_s = t
                        rec.chunk_s.append(t)
                        token_chunks += 1
                    if chunk.usage is not None:
                        usage_tokens = chunk.usage.completion_tokens
            if stream_error is not None:
                raise AnswerError(f"the server sent an error mid-stream: {stream_error}")
            rec.tokens_from_usage = usage_tokens is not None
            rec.tokens = usage_tokens if usage_tokens is not None else token_chunks
            if rec.first_token_s is None:
                raise AnswerError("the stream ended without any token")
            if not finished:  # closed, or [DONE] sent, before the answer's end: its latency is no answer's
                raise AnswerError("the stream ended before the answer did (no finish_reason)")
            # With ignore_eos only a cut answer is short; its TBT and e2e would flatter the server.
            # Without a usage count the chunks are no measure of tokens, so nothing is claimed then.
            if opts.ignore_eos and usage_tokens is not None and usage_tokens < rec.max_tokens:
                raise AnswerError(f"the answer stopped after {usage_tokens} of {rec.max_tokens} tokens, though "
                                  f"ignore_eos was asked (--no-ignore-eos if the server does not honour it)")
            rec.status, rec.end_s = OK, now()
            return
        except openai.APIStatusError as exc:
            wait = retry_after_s(exc.response.headers)
            # A 503 that says when to come back (our conductor's with no decode worker ready, a
            # draining server) is a refusal before any work, as a 429 is; any other status is an error.
            if exc.status_code != 429 and not (exc.status_code == 503 and wait is not None):
                rec.status, rec.error, rec.end_s = ERROR, f"HTTP {exc.status_code}: {exc.message}", now()
                rec.first_token_s = None
                return
            # The whole time since the first send counts, answers included: a Retry-After of 0
            # sleeps for nothing, and --max-retry-wait must still end the retries.
            since_first_send = now() - rec.sent_s
            if not opts.retry_after:
                why = ""
            elif wait is None:
                why = " (no usable Retry-After to wait for)"
            elif since_first_send + wait > opts.max_retry_wait_s:
                why = (f" (a retry after {wait:g} s would come {since_first_send + wait:.1f} s after the first send, "
                       f"past --max-retry-wait {opts.max_retry_wait_s:g} s)")
            elif rec.attempts >= MAX_ATTEMPTS:
                why = f" (still refused after {rec.attempts} attempts)"
            else:
                await asyncio.sleep(wait)
                continue
            rec.status, rec.error, rec.end_s = REFUSED, f"{exc.message}{why}", now()  # "Error code: 429 - ..."
            rec.first_token_s = None
            return
        except AnswerError as exc:
            rec.status, rec.error = ERROR, str(exc)
        except openai.APIConnectionError as exc:
            rec.status, rec.error = ERROR, connection_error_text(exc)
        except openai.APIError as exc:  # the SDK's reading of a {"error": {...}} event mid-stream
            rec.status, rec.error = ERROR, f"the server sent an error mid-stream: {exc.message}"
        except TimeoutError:
            rec.status, rec.error = ERROR, f"no whole answer within {opts.request_timeout_s:g} s (--request-timeout)"
        except Exception as exc:  # noqa: BLE001  a broken stream mid-run is that request's error
            rec.status, rec.error = ERROR, f"{type(exc).__name__}: {exc}"
        rec.end_s = now()
        rec.first_token_s = None  # a request that failed has no latency, whatever it got first
        return


async def run_schedule(client: AsyncOpenAI, opts: ClientOptions, prompts: Sequence[str | list[int]],
                       records: list[RequestRecord], desc: str) -> None:
    """Send prompts[i] at records[i].scheduled_s (seconds from now); returns when all are done.
    prompts[i] is read when its request is due (a lazy sequence builds each prompt then)."""
    t0 = time.perf_counter()
    bar = tqdm(total=len(records), desc=desc, unit="req", leave=True)

    async def one(i, rec):
        delay = rec.scheduled_s - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        await send_one(client, opts, prompts[i], rec, t0)
        bar.update(1)

    try:
        await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))
    finally:
        bar.close()


def connection_error_text(exc: BaseException) -> str:
    """A connection error with what the HTTP library raised under it, by type: its message is
    often empty (a server that closed a pooled connection: "RemoteProtocolError: Server
    disconnected without sending a response")."""
    cause = exc.__cause__ or exc.__context__
    if cause is None:
        return f"{type(exc).__name__}: {exc}"
    return f"{type(exc).__name__}: {type(cause).__name__}: {cause}"
