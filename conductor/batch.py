"""A completions request with several prompts, answered as vLLM answers it: each prompt is its
own request to the cluster (admitted, routed and priced on its own, so a batch spreads over the
instances like separate requests would), and the answer is one body or one stream in which
prompt k's choice j has index k * n + j and usage sums the prompts.

All prompts are validated before any is admitted, and all are started (run to their first
token) before the answer begins: a prompt refused or failed before then fails the whole request
with its error, and the prompts already started are cancelled and released, so nothing is
generated for nobody and nothing is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from fastapi.responses import JSONResponse

from conductor.errors import APIError
from conductor.lifecycle import LifeStreamingResponse, release_all
from conductor.schemas import CompletionRequest
from conductor.serving import CompletionService, Prepared, Started


async def prepare_batch(service: CompletionService, body: CompletionRequest,
                        headers: Mapping[str, str] | None) -> list[Prepared]:
    """Each prompt prepared as a request of its own; an error names the prompt it is about."""
    prompts = body.prompts()
    if len(prompts) > service.config.max_in_flight:
        raise APIError(400, f"a batch of {len(prompts)} prompts exceeds this conductor's limit of "
                            f"{service.config.max_in_flight} requests in flight; send smaller batches",
                       param="prompt", code="invalid_value")
    prepared = []
    for k, prompt in enumerate(prompts):
        try:
            prepared.append(await service.prepare(body.model_copy(update={"prompt": prompt}), headers))
        except APIError as exc:
            raise APIError(exc.status, f"prompt {k}: {exc.message}", param=exc.param, code=exc.code,
                           headers=exc.headers) from exc
    return prepared


async def serve_batch(service: CompletionService, reqs: list[Prepared], endpoint: str):
    started = await _start_all(service, reqs, endpoint)
    lives = [s.life for s in started]
    parts = list(zip(reqs, started))
    if reqs[0].stream:
        return LifeStreamingResponse(service.sse(parts), lives, media_type="text/event-stream",
                                     headers=_joined_headers([s.headers for s in started]))
    try:
        answers = await _all_or_none([service.whole(req, s) for req, s in parts], lives)
    finally:
        await release_all(lives)
    n = reqs[0].n
    choices = [dict(choice, index=k * n + choice["index"])
               for k, (body, _) in enumerate(answers) for choice in body["choices"]]
    body = dict(answers[0][0], choices=choices, usage=_summed([body["usage"] for body, _ in answers]))
    return JSONResponse(body, headers=_joined_headers([h for _, h in answers]))


async def _start_all(service: CompletionService, reqs: list[Prepared], endpoint: str) -> list[Started]:
    """Every prompt admitted, then all run to their first token; on a failure nothing is held."""
    lives = []
    try:
        for req in reqs:
            lives.append(service.admit(req, endpoint))  # counts its own refusal
    except APIError as exc:
        for life in lives:
            life.status = str(exc.status)
        await release_all(lives)
        raise
    return await _all_or_none([service.start(req, life) for req, life in zip(reqs, lives)], lives)


async def _all_or_none(coroutines, lives) -> list:
    """All results, or the first failure once the others are cancelled. The lives of the batch's
    prompts answer with that failure's status (a cancellation from outside, the client leaving,
    keeps theirs); the caller releases them (a start releases its own when it fails)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as exc:
        status = str(exc.status) if isinstance(exc, APIError) else "500" if isinstance(exc, Exception) else None
        for life in lives:
            life.status = life.status or status
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await release_all([r.life for r in results if isinstance(r, Started)])
        raise


def _summed(usages: list[dict]) -> dict:
    total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {
        "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return total


def _joined_headers(per_prompt: list[dict[str, str]]) -> dict[str, str]:
    """The x-mooncake-* headers of each prompt, comma-joined in prompt order."""
    keys = dict.fromkeys(k for h in per_prompt for k in h)
    return {k: ",".join(h.get(k, "") for h in per_prompt) for k in keys}
