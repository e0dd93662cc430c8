"""The pool connector's scheduler half, in vLLM's scheduler: which prefix blocks come from the
node's KVCache pool, and which computed blocks go into it.

Loads. For a new request, the prompt's full blocks beyond what vLLM's own prefix cache holds are
looked up in the pool (keys: `mooncake.hashing` in the engine's block size); the leading run of
present blocks is offered to vLLM as external tokens (the worker half pins them while it reads). A hit held entirely in the
DRAM tier loads synchronously: the worker half copies it from the shared-memory arena layer by
layer while the step computes the rest of the prompt (a layer's copy takes microseconds per block,
the rest of the prompt milliseconds per layer, so the copy hides behind compute). A hit that
includes SSD blocks loads asynchronously: reading a file takes milliseconds per block, longer
than the step, so the request waits outside the batch (vLLM's WAITING_FOR_REMOTE_KVS) while the
pool promotes its blocks to DRAM and the worker copies them in; nothing else waits on it.

Saves. Every step, each scheduled request's full blocks not yet handed to the pool (computed in
this step, or earlier: a prefix hit of vLLM's own cache, KV pulled from a prefill worker, the
answer's tokens as they are decoded; never the blocks it loaded from the pool) get reserved slots
in the arena; the worker half copies each layer into them as soon as that layer has been
computed, on a background thread, and commits them after the last layer. A request with saves in
flight keeps its blocks when it finishes (vLLM's delayed free: request_finished returns True)
until the worker half reports the copies done.

Everything here runs inside vLLM's scheduler, so a pool that does not answer costs a cache miss
(the prompt is computed), never a stuck engine: the client's calls are bounded by a timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake.hashing import BlockHash, hash_block_tokens, hash_prompt_blocks
from mooncake.protocol import CONSUMER_KEY, BadTransferParams, FetchParams, parse_fetch
from store.channel import PoolClient, PoolSilent, PoolUnavailable

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.mooncake." + __name__)

DRAM = "dram"


@dataclass(frozen=True)
class PoolLoad:
    """Copy the pool's blocks `keys` into the paged cache at `block_ids`. `sync`: all were in the
    DRAM tier at lookup, so they load layer by layer within this step; otherwise some are on SSD
    and the request waits outside the batch while the pool brings them to DRAM."""

    request_id: str
    keys: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    sync: bool
    peer: str | None = None  # fetch the blocks from this pool (another node's) first


@dataclass(frozen=True)
class PoolSave:
    """Copy blocks `block_ids` of the paged cache into the arena `slots` reserved for `keys`, then
    commit them."""

    request_id: str
    keys: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    # The request's blocks from its first through its last saved one: what the saved blocks were
    # computed over (a block's KV depends on the blocks before it and on itself only). Another request may hold some of them through vLLM's prefix cache; if one
    # of those fails to load, these saves hold wrong KV too.
    prefix_ids: tuple[int, ...] = ()


@dataclass
class _Hit:
    start_block: int  # first block of the hit (vLLM's own cache holds the ones before)
    keys: tuple[BlockHash, ...]
    in_dram: bool
    peer: str | None = None  # the blocks come from this other node's pool (Algorithm 1's fetch_from)


@dataclass
class _Tracked:
    """What the planner keeps per live request."""

    request: "Request"
    keys: list[BlockHash] = field(default_factory=list)  # chained keys of its full blocks so far
    handed: int = 0  # blocks [0, handed) were offered to the pool (saved, or found there)
    loaded: range = range(0)  # blocks loaded from the pool: never saved (see after_alloc)


@dataclass
class PlannerStats:
    lookups: int = 0
    hit_blocks: int = 0
    sync_loads: int = 0
    async_loads: int = 0
    saved_blocks: int = 0
    pool_errors: int = 0


class PoolPlanner:
    def __init__(self, client: PoolClient, block_size: int):
        self._client = client
        self._block_size = block_size
        self._kv_cache_manager: KVCacheManager | None = None
        self._hits: dict[str, _Hit] = {}  # looked up and pinned, not allocated yet
        self._loads: list[PoolLoad] = []  # planned since the last step
        self._tracked: dict[str, _Tracked] = {}
        self._saving: set[str] = set()  # requests with saves handed to the worker half
        self._waited: set[str] = set()  # requests that had an asynchronous load: never offered twice
        self._loaded: dict[str, int] = {}  # prompt tokens each request loaded from the pool
        self.stats = PlannerStats()

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager

    # -- loads ----------------------------------------------------------------------------

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if CONSUMER_KEY in (request.kv_transfer_params or {}):
            return 0, False  # its prompt arrives from a prefill worker (the serve connector)
        if request.request_id in self._waited:
            # Its asynchronous load ended (a failed one too, which vLLM recomputes): offering it
            # again could fail the same way forever.
            return 0, False
        start = num_computed_tokens // self._block_size
        # vLLM must compute at least the prompt's last token, to sample from it.
        end = (request.num_tokens - 1) // self._block_size
        hit = self._hits.get(request.request_id)
        if hit is not None and hit.start_block != start:  # asked again from another point
            hit = None
        if hit is None:
            if end <= start:
                return 0, False
            self._tracked.setdefault(request.request_id, _Tracked(request))
            keys = self._keys(request, end)[start:end]
            self.stats.lookups += 1
            try:
                tiers = self._client.lookup(keys)
            except PoolUnavailable as exc:
                self.stats.pool_errors += 1
                # While the pool is silent every new request would say so; the call that went
                # unanswered already did.
                log.log(logging.DEBUG if isinstance(exc, PoolSilent) else logging.WARNING,
                        "pool lookup failed (%s); computing the prompt", exc)
                return 0, False
            # A resumed request may hold its blocks past its end for transfers from before its
            # preemption (pool saves, KV pushes); an asynchronous load would be a second hold,
            # which vLLM does not take: an abort during the load frees the blocks at the first
            # report while the load still writes them, and its own report then fails vLLM's
            # scheduler. Such a request loads only what DRAM holds (synchronous) and computes the rest.
            resumed = getattr(request, "num_preemptions", 0) > 0
            fetch = None if resumed else self._fetch_of(request)
            if fetch is not None:
                remote_end = min(fetch.num_tokens // self._block_size, end)
                if remote_end - start > len(tiers):  # the other node has more: bring it here
                    hit = _Hit(start, tuple(keys[:remote_end - start]), False, fetch.peer)
                    self._hits[request.request_id] = hit
                    return len(hit.keys) * self._block_size, True
            if not tiers:
                return 0, False
            # Not pinned here: the worker half pins them when it reads them, on its own line to the
            # pool, and unpins them once copied. A block evicted in between is reported as not loaded
            # and vLLM recomputes it.
            if resumed and not all(t == DRAM for t in tiers):
                tiers = tiers[:next(i for i, t in enumerate(tiers) if t != DRAM)]  # the DRAM-held lead
                if not tiers:
                    return 0, False
            hit = _Hit(start, tuple(keys[:len(tiers)]), all(t == DRAM for t in tiers))
            self._hits[request.request_id] = hit
        return len(hit.keys) * self._block_size, not hit.in_dram

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        hit = self._hits.pop(request.request_id, None)
        if hit is None or num_external_tokens <= 0:  # another connector loads it, or no hit
            return
        count = num_external_tokens // self._block_size
        # The loaded blocks are the pool's already, and never saved back: a load that fails (the
        # block was evicted since the lookup) leaves the engine's block as it was, old KV of another
        # request, which a save in the same step would copy into the pool as this prefix's.
        tracked.loaded = range(hit.start_block, hit.start_block + count)
        block_ids = blocks.get_block_ids()[0][hit.start_block: hit.start_block + count]
        self._loads.append(PoolLoad(request.request_id, hit.keys[:count], tuple(block_ids), hit.in_dram, hit.peer))
        if not hit.in_dram:
            self._waited.add(request.request_id)
        self.stats.hit_blocks += count
        if request.num_output_tokens == 0:  # a load after the first token (a preempted request's) is no prefill's
            self._loaded[request.request_id] = max(self._loaded.get(request.request_id, 0), count * self._block_size)
        if hit.in_dram:
            self.stats.sync_loads += 1
        else:
            self.stats.async_loads += 1

    # -- saves and per-step metadata ------------------------------------------------------

    def plan(self, scheduler_output: "SchedulerOutput") -> tuple[list[PoolLoad], list[PoolSave], tuple[str, ...]]:
        """(loads, saves, requests whose saves must finish before this step writes the cache)."""
        loads, self._loads = self._loads, []
        preempted = set(scheduler_output.preempted_req_ids or ())
        for req_id in preempted:  # its blocks were freed; it starts over when resumed
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.handed, tracked.loaded = 0, range(0)
        progress: dict[str, int] = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress[req_id] = cached.num_computed_tokens[i]
        saves = []
        for req_id, computed in progress.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            save = self._plan_save(tracked, done)
            if save is not None:
                saves.append(save)
        return loads, saves, tuple(sorted(preempted & self._saving))

    def _plan_save(self, tracked: _Tracked, done_tokens: int) -> PoolSave | None:
        request = tracked.request
        full = min(done_tokens, request.num_tokens) // self._block_size
        if full <= tracked.handed:
            return None
        wanted = [i for i in range(tracked.handed, full) if i not in tracked.loaded]
        tracked.handed = full  # not offered again, whatever the pool answers (it is a cache)
        if not wanted:
            return None
        all_keys, all_ids = self._keys(request, full), self._block_ids(request.request_id)
        keys, block_ids = [all_keys[i] for i in wanted], [all_ids[i] for i in wanted]
        try:
            reserved = dict(self._client.reserve(keys))  # key -> slot, for the keys it lacks
        except PoolUnavailable as exc:
            self.stats.pool_errors += 1
            log.log(logging.DEBUG if isinstance(exc, PoolSilent) else logging.WARNING,
                    "pool reserve failed (%s); %d blocks not saved", exc, len(keys))
            return None
        picked = [(i, k, b, reserved[k]) for i, k, b in zip(wanted, keys, block_ids) if k in reserved]
        if not picked:  # all held already, or no room
            return None
        self._saving.add(request.request_id)
        self.stats.saved_blocks += len(picked)
        return PoolSave(request.request_id, tuple(k for _, k, _, _ in picked), tuple(b for _, _, b, _ in picked),
                        tuple(s for _, _, _, s in picked), prefix_ids=tuple(all_ids[:picked[-1][0] + 1]))

    def finished(self, request: "Request") -> tuple[bool, int]:
        """(keep: True to keep the request's blocks until the worker half reports its saves
        copied, the prompt tokens it loaded from the pool)."""
        req_id = request.request_id
        self._hits.pop(req_id, None)
        self._waited.discard(req_id)
        self._tracked.pop(req_id, None)
        loaded = self._loaded.pop(req_id, 0)
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True, loaded
        return False, loaded

    # -- helpers --------------------------------------------------------------------------

    def _keys(self, request: "Request", blocks: int | None = None) -> list[BlockHash]:
        """The chained keys of the request's first `blocks` full blocks (all full blocks by
        default), extended incrementally as its tokens grow."""
        tracked = self._tracked.get(request.request_id)
        tokens = request.all_token_ids
        want = len(tokens) // self._block_size if blocks is None else blocks
        if tracked is None:
            return hash_prompt_blocks(tokens[:want * self._block_size], self._block_size)
        have = len(tracked.keys)
        if want > have:
            parent = tracked.keys[-1] if tracked.keys else None
            bs = self._block_size
            for i in range(have, want):
                parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
                tracked.keys.append(parent)
        return tracked.keys[:want]

    @staticmethod
    def _fetch_of(request: "Request") -> FetchParams | None:
        try:
            return parse_fetch(request.kv_transfer_params)
        except BadTransferParams as exc:  # never kill the scheduler over one bad instruction
            log.error("request %s: ignoring %s", request.request_id, exc)
            return None

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
