"""The producer's plan, made in vLLM's scheduler process: which prompt blocks to push, and when.

Runs inside vLLM's scheduler, so it must be cheap and never block: it reads `kv_transfer_params`
and block tables only, and hands SaveSpecs to the sender (prefill/kv_sender.py) through the
connector's per-step metadata.

KV streams through every chunk of a long prompt: each step pushes the blocks whose tokens are all
computed once that step ends (the final step also the last, partial block), and the planner
remembers how far each request got, so no block goes twice. The blocks the decode worker already
holds (`PushParams.skip_blocks`) never go.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.hashing import blocks_for
from mooncake.protocol import BadTransferParams, PushParams, parse_push

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


log = logging.getLogger(__name__)


def push_of(request: "Request") -> PushParams | None:
    """The request's push instruction; None when it has none or a malformed one."""
    try:
        return parse_push(request.kv_transfer_params)
    except BadTransferParams as exc:
        # Raising here would kill vLLM's scheduler, and every request on this worker with it,
        # over one bad instruction. Without the push, the decode side times out and recomputes.
        log.error("request %s: ignoring %s", request.request_id, exc)
        return None


@dataclass(frozen=True)
class SaveSpec:
    """After this step's forward, push prompt blocks [first_block, first_block + len(block_ids))
    of the transfer, which live at `block_ids` in the paged cache. The transfer as a whole covers
    blocks [skip_blocks, total_blocks); `final` marks the step that computes the last prompt token."""

    request_id: str
    transfer_id: str
    dest: str
    block_ids: tuple[int, ...]
    first_block: int
    skip_blocks: int
    total_blocks: int
    num_tokens: int
    final: bool


@dataclass
class _Push:
    params: PushParams
    next_block: int  # the first block not planned yet


class PushPlanner:
    def __init__(self, block_size: int):
        self._block_size = block_size
        self._kv_cache_manager: KVCacheManager | None = None
        self._pushes: dict[str, _Push] = {}  # producer requests whose final step is not planned yet
        self._streamed: set[str] = set()  # requests with at least one SaveSpec: the worker tracks them
        # Of the streamed requests: their transfer, the end of the blocks planned so far and the
        # block ids they were planned from (kept past the final step, for blocks vLLM reports
        # invalid after they went: `invalid_blocks`).
        self._planned: dict[str, tuple[str, int, tuple[int, ...]]] = {}

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager

    def after_alloc(self, request: "Request") -> None:
        if request.request_id in self._pushes or request.request_id in self._streamed:
            return  # allocated again for a later chunk (or after a preemption): keep the progress
        push = push_of(request)
        if push is not None:
            total = blocks_for(push.num_tokens, self._block_size)
            self._pushes[request.request_id] = _Push(push, next_block=min(max(push.skip_blocks, 0), total))

    def plan(self, scheduler_output: "SchedulerOutput") -> list[SaveSpec]:
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress[req_id] = cached.num_computed_tokens[i]
        saves: list[SaveSpec] = []
        for req_id, computed in progress.items():
            push = self._pushes.get(req_id)
            if push is None:
                continue
            spec = self._step(req_id, push, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if spec is not None:
                saves.append(spec)
                self._streamed.add(req_id)
                self._planned[req_id] = (spec.transfer_id, push.next_block,
                                         tuple(self._block_ids(req_id)[:push.next_block]))
                if spec.final:
                    del self._pushes[req_id]
        return saves

    def _step(self, req_id: str, push: _Push, done_after_step: int) -> SaveSpec | None:
        params = push.params
        total = blocks_for(params.num_tokens, self._block_size)
        final = done_after_step >= params.num_tokens
        # Full blocks are final once computed: their KV never changes. The last, partial block
        # goes in the final step only (later tokens of this request would write into it).
        end = total if final else min(done_after_step // self._block_size, total)
        start = push.next_block
        if end <= start and not final:
            return None
        push.next_block = max(end, start)
        return SaveSpec(
            request_id=req_id, transfer_id=params.transfer_id, dest=params.dest,
            block_ids=tuple(self._block_ids(req_id)[start:end]) if end > start else (),
            first_block=start, skip_blocks=min(max(params.skip_blocks, 0), total), total_blocks=total,
            num_tokens=params.num_tokens, final=final,
        )

    def invalid_blocks(self, block_ids: set[int]) -> list[tuple[str, str]]:
        """vLLM reports blocks whose KV failed to load (a pool read that failed its checksum or
        lost its block) and recomputes from the first of them; every token computed after it in
        that step attended over the bad KV. Returns (request id, transfer id) of the streamed
        requests that already planned blocks from such a block on: their pushes carried wrong KV
        and must fail (the decode side then recomputes)."""
        if not block_ids:
            return []
        hit = []
        for req_id, (transfer_id, planned_end, planned_ids) in self._planned.items():
            # None once freed or preempted: with async scheduling (vLLM's default on GPU) the next
            # step may preempt a request before this step's failed loads are reported; its pushes
            # still ran over the blocks they were planned from.
            ids = self._block_ids(req_id) or planned_ids
            first_bad = next((i for i, b in enumerate(ids) if b in block_ids), None)
            if first_bad is not None and first_bad < planned_end:
                hit.append((req_id, transfer_id))
        return hit

    def preempted(self, request_ids: set[str] | None) -> set[str]:
        """Of the requests vLLM preempted this step, those with sends of their blocks: their blocks
        go back to the pool, so the worker must let those sends finish first."""
        return {r for r in request_ids or () if r in self._streamed}

    def finished(self, request_id: str) -> bool:
        """The request ended; True when the worker has sends of it to finish (vLLM then keeps
        its blocks until the worker reports it in finished_sending: the delayed free)."""
        self._pushes.pop(request_id, None)
        self._planned.pop(request_id, None)
        if request_id in self._streamed:
            self._streamed.discard(request_id)
            return True
        return False

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
