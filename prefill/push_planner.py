"""The producer's plan, made in vLLM's scheduler process: which prompt blocks to push, and when.

Runs inside vLLM's scheduler, so it must be cheap and never block: it reads `kv_transfer_params`
and block tables only, and hands SaveSpecs to the sender (prefill/kv_sender.py) through the
connector's per-step metadata.
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
    """Push the KV of `block_ids` (all blocks holding the prompt) to `dest` once this step ends."""

    request_id: str
    transfer_id: str
    dest: str
    block_ids: tuple[int, ...]
    num_tokens: int


class PushPlanner:
    def __init__(self, block_size: int):
        self._block_size = block_size
        self._kv_cache_manager: KVCacheManager | None = None
        self._pushes: dict[str, PushParams] = {}  # producer requests not yet pushed

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager

    def after_alloc(self, request: "Request") -> None:
        push = push_of(request)
        if push is not None:
            self._pushes[request.request_id] = push

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
            done_after_step = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # Push once, in the step that computes the prompt's last token: by then every layer
            # of every prompt block is in the paged cache (earlier chunks included).
            if done_after_step < push.num_tokens:
                continue
            saves.append(SaveSpec(
                request_id=req_id, transfer_id=push.transfer_id, dest=push.dest,
                block_ids=tuple(self._block_ids(req_id)[: blocks_for(push.num_tokens, self._block_size)]),
                num_tokens=push.num_tokens,
            ))
            del self._pushes[req_id]
        return saves

    def finished(self, request_id: str) -> None:
        self._pushes.pop(request_id, None)

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
