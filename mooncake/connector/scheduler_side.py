"""The connector's scheduler half: decides, per step, which prompts to push and which to load.

Runs inside vLLM's scheduler, so it must be cheap and must not block: it only reads
`kv_transfer_params` and block tables, and hands plans to the worker half.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mooncake.connector.metadata import LoadSpec, MooncakeConnectorMetadata, SaveSpec
from mooncake.connector.params import PushParams, parse_pull, parse_push

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under "vllm." so the messages show in vLLM's worker processes, whose logging vLLM configures.
log = logging.getLogger("vllm.mooncake." + __name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ConnectorScheduler:
    def __init__(self, block_size: int):
        self._block_size = block_size
        self._kv_cache_manager: KVCacheManager | None = None
        self._pushes: dict[str, PushParams] = {}  # producer requests not yet pushed
        self._loads: list[LoadSpec] = []  # consumer loads planned since the last step
        self._attempted: set[str] = set()  # consumer requests whose load was already planned

    def bind_kv_cache_manager(self, manager: "KVCacheManager") -> None:
        self._kv_cache_manager = manager

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        pull = parse_pull(request.kv_transfer_params)
        if pull is None or request.request_id in self._attempted:
            # A load that already happened (or failed and fell back to recompute) is not offered
            # twice: a retry must compute, not wait for bytes that were consumed.
            return 0, False
        available = min(pull.num_tokens, len(request.prompt_token_ids or ()))
        count = available - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        push = parse_push(request.kv_transfer_params)
        if push is not None:
            self._pushes[request.request_id] = push
        pull = parse_pull(request.kv_transfer_params)
        if pull is None or num_external_tokens <= 0:
            return
        available = min(pull.num_tokens, len(request.prompt_token_ids or ()))
        local_tokens = available - num_external_tokens  # block-aligned local prefix-cache hit
        first = local_tokens // self._block_size
        last = _cdiv(available, self._block_size)
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(LoadSpec(
            request_id=request.request_id, transfer_id=pull.transfer_id,
            block_ids=tuple(block_ids[first:last]), first_block=first,
            num_tokens=available, wait_timeout_s=pull.wait_timeout_s,
        ))
        self._attempted.add(request.request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self._loads)
        self._loads = []
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            push = self._pushes.get(req_id)
            if push is None:
                continue
            done_after_step = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # Push once, in the step that computes the prompt's last token: by then every layer
            # of every prompt block is in the paged cache (earlier chunks included).
            if done_after_step < push.num_tokens:
                continue
            meta.saves.append(SaveSpec(
                request_id=req_id, transfer_id=push.transfer_id, dest=push.dest,
                block_ids=tuple(self._block_ids(req_id)[: _cdiv(push.num_tokens, self._block_size)]),
                num_tokens=push.num_tokens,
            ))
            del self._pushes[req_id]
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pushes.pop(request.request_id, None)
        self._attempted.discard(request.request_id)
        return False, None

    def _block_ids(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind the KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])
