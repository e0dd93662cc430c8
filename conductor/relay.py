"""One request's trip through the workers: prefill on P (which pushes the prompt's KV to D),
then decode on D, relayed as one stream of tokens.

The first token comes from the prefill worker, so TTFT does not wait for the decode worker.
D receives the prompt plus that token, loads the prompt's KV through the connector and computes
only the new tokens. When P and D are the same instance (the scheduler chose to prefill where
it decodes), the request runs there whole. If D fails before its first token, the request is
retried on another decode-capable worker, which recomputes the prompt: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from msgspec.structs import replace  # Sampling is a msgspec Struct

from conductor.routing import Route
from conductor.workers import EngineFailed, RequestRefused, WorkerClient, WorkerError, WorkerHandle
from mooncake.protocol import GenerateChunk, GenerateRequest, PullParams, PushParams, Sampling

log = logging.getLogger(__name__)


@dataclass
class RelayStats:
    # Prompt tokens the worker that computed the prompt found in a prefix cache (its own or its
    # KVCache pool): what usage.prompt_tokens_details.cached_tokens reports.
    prefill_cached_tokens: int = 0
    decode_cached_tokens: int | None = None  # prompt tokens D did not compute (loaded KV)
    decode_instance: str = ""
    retried: bool = False
    # What the workers measured (their last chunk), for the conductor's calibration:
    prompt_tokens: int = 0
    prefill_instance: str = ""  # where the prompt was computed
    computed_cached_tokens: int = 0  # prompt tokens prefill_instance did not compute
    prefill_s: float | None = None  # prefill_instance's time for the prompt (None: not measured)
    prefill_concurrent: int | None = None  # other prompts it computed meanwhile (0: a calibration sample)
    prefill_loaded_tokens: int = 0  # prompt tokens it loaded from a KVCache pool (their load is in prefill_s)
    decode_step_s: float | None = None  # decode_instance's mean step (None: fewer than 2 tokens there)
    decode_concurrent: int | None = None  # other prompts it computed meanwhile (0: a calibration sample)
    # n > 1: the prompt tokens each further sample found cached on the decode worker (its prefix
    # cache holds the KV the first sample loaded), in the order they started.
    sibling_cached_tokens: list[int] = field(default_factory=list)

    def prefill_measured(self, chunk: GenerateChunk) -> None:
        """Take the prefill figures of the last chunk of the worker that computed the prompt."""
        self.prefill_s, self.prefill_concurrent = chunk.prefill_s, chunk.prefill_concurrent
        self.prefill_loaded_tokens = chunk.prefill_loaded_tokens or 0

    def decode_moved(self, failed: str, to: str) -> None:
        """`failed`, the decode worker, failed before its first token and `to` took the request
        over. What `failed` reported (the cached tokens of a token-less first chunk, which a
        prompt's logprobs can come in) is not `to`'s, so it goes. If `failed` was to compute the
        prompt too (colocated), `to` computes it now and the prompt's figures start afresh; if
        the prompt was computed elsewhere (a prefill worker whose push failed), that worker's
        measurement stays its own (a shared `prefill_instance` used to hand it to `to`)."""
        self.decode_instance, self.retried = to, True
        self.decode_cached_tokens = self.decode_step_s = self.decode_concurrent = None
        if self.prefill_instance == failed:
            self.prefill_instance = to
            self.prefill_cached_tokens = self.computed_cached_tokens = self.prefill_loaded_tokens = 0
            self.prefill_s = self.prefill_concurrent = None


class Relay:
    def __init__(self, client: WorkerClient, kv_wait_timeout_s: float,
                 pick_fallback: Callable[[set[str]], WorkerHandle | None],
                 on_retry: Callable[[str], None] = lambda stage: None,
                 on_moved: Callable[[Route, WorkerHandle], None] = lambda route, worker: None,
                 on_prefilled: Callable[[Route], None] = lambda route: None):
        """`on_retry(stage)`: a request moved to another worker ("decode": its decode worker
        failed before its first token; the conductor's metrics count it). `on_moved(route,
        worker)`: that worker took over the route's decode (Router.move_decode).
        `on_prefilled(route)`: the prefill worker is done with the prompt, and the first token
        will come from the decode worker (Router.prefill_ended)."""
        self._client = client
        self._kv_wait_timeout_s = kv_wait_timeout_s
        self._pick_fallback = pick_fallback
        self._on_retry = on_retry
        self._on_moved = on_moved
        self._on_prefilled = on_prefilled
        self._drops: set[asyncio.Task] = set()  # drop_transfer calls sent while a request was let go

    def _drop_soon(self, worker: WorkerHandle, transfer_id: str) -> None:
        """Tell `worker` to free the KV pushed for a request that was let go (its stream closed
        or cancelled, which cannot wait for the call): without it the staged bytes sit there
        until their TTL. Best effort: the TTL still frees them if this fails."""
        try:
            task = asyncio.get_running_loop().create_task(self._client.drop_transfer(worker, transfer_id))
        except RuntimeError:  # no loop running (an iterator collected at exit): the TTL frees them
            return
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    async def run(self, request_id: str, prompt: list[int], sampling: Sampling, route: Route,
                  stats: RelayStats) -> AsyncIterator[GenerateChunk]:
        """Yield chunks of generated tokens; the last one has a finish_reason."""
        stats.decode_instance, stats.prefill_instance = route.decode.name, route.prefill.name
        stats.prompt_tokens = len(prompt)
        fetch = route.fetch.to_params() if route.fetch else {}
        if route.colocated:
            async for chunk in self._whole(route.decode, request_id, prompt, sampling, stats, None, fetch, route=route):
                yield chunk
            return

        push = PushParams(transfer_id=request_id, dest=route.decode.kv_address, num_tokens=len(prompt),
                          skip_blocks=skip_blocks(route, len(prompt), sampling.first_token_on_decode()))
        first_sampling = replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1),
                                 structured=None)  # with a grammar (and more), P's token is not used (below)
        prefill_only = sampling.ends_at_prefill()  # P's token is the whole answer: no KV for D to drop
        # The pushed KV is settled once D answered its request (aborting that frees the KV there)
        # or it was dropped. A request let go before (the client left, P failed) drops it here:
        # D would otherwise hold it until its staging TTL.
        settled = prefill_only
        try:
            first = GenerateChunk([])
            async for chunk in self._client.generate(
                route.prefill, GenerateRequest(f"{request_id}-p", prompt, first_sampling,
                                               fetch if prefill_only else {**push.to_params(), **fetch})
            ):
                if chunk.num_cached_tokens is not None:
                    stats.prefill_cached_tokens = stats.computed_cached_tokens = chunk.num_cached_tokens
                if chunk.prefill_s is not None:
                    stats.prefill_measured(chunk)
                first = joined(first, chunk)
            pull = None if prefill_only else PullParams(transfer_id=request_id, num_tokens=len(prompt),
                                                        wait_timeout_s=self._kv_wait_timeout_s)
            if first.kv_error is not None:  # the KV did not land: D computes the prompt, waiting for nothing
                log.warning("KV push for %s failed (%s); %s recomputes the prompt", request_id, first.kv_error,
                            route.decode.name)
                await self._client.drop_transfer(route.decode, request_id)
                pull, stats.retried = None, True  # D's prompt time is not P's: keep P's measurement
            rest = replace(sampling, prompt_logprobs=None)  # the prompt's came from the prefill worker
            if sampling.first_token_on_decode():
                # A grammar's state, output-token penalties and a seeded generator cannot cross
                # workers: P's token is dropped and D, which loads the whole prompt's KV (it recomputes
                # only the last prompt token), samples from the start, as one engine would.
                self._on_prefilled(route)  # P's queue moves on now, not at D's first token
                async for chunk in self._whole(route.decode, request_id, prompt, rest, stats, pull, route=route):
                    settled = True
                    if first.prompt_logprobs:
                        chunk, first = replace(chunk, prompt_logprobs=first.prompt_logprobs), GenerateChunk([])
                    yield chunk
                return
            tokens, finish = first.token_ids, first.finish_reason
            if finish == "stop" or sampling.max_tokens <= len(tokens):
                if not prefill_only:
                    await self._client.drop_transfer(route.decode, request_id)
                settled = True
                yield replace(first, finish_reason=finish or "length")
                return
            yield replace(first, finish_reason=None)

            rest = replace(rest, max_tokens=sampling.max_tokens - len(tokens),
                           min_tokens=max(0, sampling.min_tokens - len(tokens)))
            async for chunk in self._whole(route.decode, request_id, prompt + tokens, rest, stats, pull, route=route):
                settled = True
                yield chunk
        finally:
            if not settled:
                self._drop_soon(route.decode, request_id)

    async def samples(self, request_id: str, prompt: list[int], sampling: Sampling, route: Route,
                      stats: RelayStats, n: int, stopped: set[int] | None = None,
                      ) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """`n` samples of one prompt, as (sample index, chunk). The prompt is prefilled once:
        sample 0 runs as `run` does (its KV pushed to the decode worker); samples 1..n-1 start on
        the decode worker once sample 0 is decoding there, so they find the prompt in its prefix
        cache and compute only its last, partial block. Closing this iterator aborts them all; a
        sample whose index the caller puts in `stopped` ends (aborted) at its next chunk."""
        stopped = set() if stopped is None else stopped
        primary = self.run(request_id, prompt, sampling, route, stats)
        queue: asyncio.Queue = asyncio.Queue()
        decoding = asyncio.Event()  # sample 0's KV is in the decode worker's cache (or it ended)

        async def pump(index: int, chunks: AsyncIterator[GenerateChunk]) -> None:
            try:
                async for chunk in chunks:
                    await queue.put((index, chunk))
                    if index == 0 and (stats.decode_cached_tokens is not None or route.colocated):
                        decoding.set()
                    if index in stopped:
                        break  # its stream is closed below, which aborts it on the worker
                await queue.put((index, None))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((index, exc))
            finally:
                if index == 0:
                    decoding.set()
                await chunks.aclose()

        async def siblings() -> None:
            await decoding.wait()
            for i in range(1, n):
                seed = None if sampling.seed is None else sampling.seed + i  # vLLM's rule for n > 1
                own = replace(sampling, seed=seed, prompt_logprobs=None)
                sibling_stats = RelayStats()
                chunks = self._sibling(route.decode, f"{request_id}-s{i}", prompt, own, sibling_stats, stats)
                tasks.append(asyncio.create_task(pump(i, chunks)))

        tasks = [asyncio.create_task(pump(0, primary))]
        tasks.append(asyncio.create_task(siblings()))
        try:
            running = n
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sibling(self, worker: WorkerHandle, request_id: str, prompt: list[int], sampling: Sampling,
                       own: RelayStats, stats: RelayStats) -> AsyncIterator[GenerateChunk]:
        async for chunk in self._whole(worker, request_id, prompt, sampling, own, None):
            if chunk.num_cached_tokens is not None:
                stats.sibling_cached_tokens.append(chunk.num_cached_tokens)
            yield chunk

    async def _whole(self, worker: WorkerHandle, request_id: str, prompt: list[int], sampling: Sampling,
                     stats: RelayStats, pull: PullParams | None,
                     fetch: dict | None = None, route: Route | None = None) -> AsyncIterator[GenerateChunk]:
        """One worker's whole stream; before its first token a failed worker is replaced by
        another (`route`, if given, moves with it: on_moved)."""
        tried: set[str] = set()
        while True:
            tried.add(worker.name)
            # A fetch is for the worker it was priced for: a retry elsewhere computes instead.
            params = pull.to_params() if pull else dict(fetch or {}) if len(tried) == 1 else {}
            try:
                async for chunk in self._client.generate(
                    worker, GenerateRequest(f"{request_id}-d{len(tried)}", prompt, sampling, params)
                ):
                    if chunk.num_cached_tokens is not None and stats.decode_cached_tokens is None:
                        stats.decode_cached_tokens = chunk.num_cached_tokens
                        if pull is None:  # this worker computed the prompt (colocated, or a recompute)
                            stats.prefill_cached_tokens = chunk.num_cached_tokens
                    if chunk.decode_step_s is not None:
                        stats.decode_step_s, stats.decode_concurrent = chunk.decode_step_s, chunk.decode_concurrent
                    if pull is None and not stats.retried and chunk.prefill_s is not None:
                        # Colocated: this worker computed the prompt too. (A retry's prompt ran
                        # elsewhere than prefill_instance, so it is not counted.)
                        stats.computed_cached_tokens = stats.decode_cached_tokens or 0
                        stats.prefill_measured(chunk)
                    yield chunk
                return
            except (RequestRefused, EngineFailed):  # any other worker would refuse or fail it too
                if pull is not None:  # the prompt's KV pushed here will not be claimed
                    await self._client.drop_transfer(worker, pull.transfer_id)
                raise
            except WorkerError as exc:
                fallback = None if exc.started else self._pick_fallback(tried)
                if fallback is None:
                    raise
                log.warning("%s failed before its first token (%s); retrying on %s", worker.name, exc, fallback.name)
                self._on_retry("decode")
                if pull is not None:  # the KV pushed to the failed worker (one that refused, say) is not claimed
                    self._drop_soon(worker, pull.transfer_id)
                stats.decode_moved(worker.name, fallback.name)
                worker, pull = fallback, None
                if route is not None:
                    self._on_moved(route, worker)


def skip_blocks(route: Route, prompt_tokens: int, first_token_on_decode: bool) -> int:
    """The prompt blocks P need not push: those D holds, as far as D's vLLM will find them cached.
    vLLM leaves at least the last token of a request to compute, so a request of n tokens hits at
    most (n - 1) // block_size blocks. D's request is the prompt plus P's token, except when D
    samples the first token itself (a grammar, ...): then it is the prompt alone, and for a prompt
    of whole blocks that D holds, skipping them all made every such pull fail (one block short)
    and recompute."""
    held = route.decode_held_blocks
    block_size = route.decode.block_size
    if not first_token_on_decode or held <= 0 or block_size <= 0:
        return held
    return min(held, (prompt_tokens - 1) // block_size)


async def sample_zero(chunks: AsyncIterator[GenerateChunk]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """One sample's chunks in the shape of Relay.samples (n = 1: no fan-out to pay for)."""
    try:
        async for chunk in chunks:
            yield 0, chunk
    finally:
        await chunks.aclose()


def joined(a: GenerateChunk, b: GenerateChunk) -> GenerateChunk:
    """Two consecutive chunks of one worker stream as one (tokens and logprobs concatenated)."""
    def cat(x, y):
        return y if x is None else x if y is None else x + y
    return replace(b, token_ids=a.token_ids + b.token_ids, logprobs=cat(a.logprobs, b.logprobs),
                   prompt_logprobs=cat(a.prompt_logprobs, b.prompt_logprobs),
                   num_cached_tokens=a.num_cached_tokens if b.num_cached_tokens is None else b.num_cached_tokens)
