"""One request's trip through the workers: prefill on P (which pushes the prompt's KV to D),
then decode on D, relayed as one stream of tokens.

The first token comes from the prefill worker, so TTFT does not wait for the decode worker.
D receives the prompt plus that token, loads the prompt's KV through the connector and computes
only the new tokens. When P and D are the same instance (the scheduler chose to prefill where
it decodes), the request runs there whole. If D fails before its first token, the request is
retried on another decode-capable worker, which recomputes the prompt: slower, never wrong.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from msgspec.structs import replace  # Sampling is a msgspec Struct

from conductor.routing import Route
from conductor.workers import WorkerClient, WorkerError, WorkerHandle
from mooncake.protocol import GenerateChunk, GenerateRequest, PullParams, PushParams, Sampling

log = logging.getLogger(__name__)


@dataclass
class RelayStats:
    prefill_cached_tokens: int = 0  # prompt tokens P found in its prefix cache
    decode_cached_tokens: int | None = None  # prompt tokens D did not compute (loaded KV)
    decode_instance: str = ""
    retried: bool = False
    # What the workers measured (their last chunk), for the conductor's calibration:
    prompt_tokens: int = 0
    prefill_instance: str = ""  # where the prompt was computed
    computed_cached_tokens: int = 0  # prompt tokens prefill_instance did not compute
    prefill_s: float | None = None  # prefill_instance's time for the prompt (None: not measured)
    decode_step_s: float | None = None  # decode_instance's mean step (None: fewer than 2 tokens there)


class Relay:
    def __init__(self, client: WorkerClient, kv_wait_timeout_s: float,
                 pick_fallback: Callable[[set[str]], WorkerHandle | None]):
        self._client = client
        self._kv_wait_timeout_s = kv_wait_timeout_s
        self._pick_fallback = pick_fallback

    async def run(self, request_id: str, prompt: list[int], sampling: Sampling, route: Route,
                  stats: RelayStats) -> AsyncIterator[GenerateChunk]:
        """Yield chunks of generated tokens; the last one has a finish_reason."""
        stats.decode_instance, stats.prefill_instance = route.decode.name, route.prefill.name
        stats.prompt_tokens = len(prompt)
        if route.colocated:
            async for chunk in self._whole(route.decode, request_id, prompt, sampling, stats, None):
                yield chunk
            return

        push = PushParams(transfer_id=request_id, dest=route.decode.kv_address, num_tokens=len(prompt))
        first_sampling = replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
        first: list[int] = []
        finish: str | None = None
        async for chunk in self._client.generate(
            route.prefill, GenerateRequest(f"{request_id}-p", prompt, first_sampling, push.to_params())
        ):
            if chunk.num_cached_tokens is not None:
                stats.prefill_cached_tokens = stats.computed_cached_tokens = chunk.num_cached_tokens
            if chunk.prefill_s is not None:
                stats.prefill_s = chunk.prefill_s
            first += chunk.token_ids
            finish = chunk.finish_reason or finish
        if finish == "stop" or sampling.max_tokens <= len(first):
            await self._client.drop_transfer(route.decode, request_id)
            yield GenerateChunk(first, finish_reason=finish or "length")
            return
        yield GenerateChunk(first)

        rest = replace(sampling, max_tokens=sampling.max_tokens - len(first),
                       min_tokens=max(0, sampling.min_tokens - len(first)))
        pull = PullParams(transfer_id=request_id, num_tokens=len(prompt), wait_timeout_s=self._kv_wait_timeout_s)
        async for chunk in self._whole(route.decode, request_id, prompt + first, rest, stats, pull):
            yield chunk

    async def _whole(self, worker: WorkerHandle, request_id: str, prompt: list[int], sampling: Sampling,
                     stats: RelayStats, pull: PullParams | None) -> AsyncIterator[GenerateChunk]:
        tried: set[str] = set()
        while True:
            tried.add(worker.name)
            params = pull.to_params() if pull else {}
            try:
                async for chunk in self._client.generate(
                    worker, GenerateRequest(f"{request_id}-d{len(tried)}", prompt, sampling, params)
                ):
                    if chunk.num_cached_tokens is not None and stats.decode_cached_tokens is None:
                        stats.decode_cached_tokens = chunk.num_cached_tokens
                    if chunk.decode_step_s is not None:
                        stats.decode_step_s = chunk.decode_step_s
                    if pull is None and not stats.retried and chunk.prefill_s is not None:
                        # Colocated: this worker computed the prompt too. (A retry's prompt ran
                        # elsewhere than prefill_instance, so it is not counted.)
                        stats.computed_cached_tokens = stats.decode_cached_tokens or 0
                        stats.prefill_s = chunk.prefill_s
                    yield chunk
                return
            except WorkerError as exc:
                fallback = None if exc.started else self._pick_fallback(tried)
                if fallback is None:
                    raise
                log.warning("%s failed before its first token (%s); retrying on %s", worker.name, exc, fallback.name)
                worker, pull, stats.retried = fallback, None, True
                stats.decode_instance = worker.name
