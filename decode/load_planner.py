"""The consumer's plan, made in vLLM's scheduler process: which prompt tokens arrive as pushed
KV instead of being computed, and which allocated blocks they land in.

Runs inside vLLM's scheduler, so it must be cheap and never block. It reports the pushed part of
a prompt as external tokens loaded asynchronously; once vLLM has allocated blocks for them it
records a LoadSpec for the receiver (decode/kv_receiver.py) to fill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.hashing import blocks_for
from mooncake.protocol import BadTransferParams, PullParams, parse_pull

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


log = logging.getLogger(__name__)


def pull_of(request: "Request") -> PullParams | None:
    """The request's pull instruction; None when it has none or a malformed one."""
    try:
        return parse_pull(request.kv_transfer_params)
    except BadTransferParams as exc:
        # Raising here would kill vLLM's scheduler, and every request on this worker with it,
        # over one bad instruction. Without the pull, the prompt is simply computed here.
        log.error("request %s: ignoring %s", request.request_id, exc)
        return None


@dataclass(frozen=True)
class LoadSpec:
    """Copy staged blocks [first_block, first_block + len(block_ids)) of `transfer_id` into
    the paged cache at `block_ids`. Blocks before `first_block` were already cached locally."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    first_block: int
    num_tokens: int
    wait_timeout_s: float


class LoadPlanner:
    def __init__(self, block_size: int):
        self._block_size = block_size
        self._loads: list[LoadSpec] = []  # planned since the last step
        self._unclaimed: list[str] = []  # transfers pulled with nothing to load, since the last step
        self._attempted: set[str] = set()  # requests whose load was already planned (or given up)

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        pull = pull_of(request)
        if pull is None or request.request_id in self._attempted:
            # A load that already happened (or failed and fell back to recompute) is not offered
            # twice: a retry must compute, not wait for bytes that were consumed.
            return 0, False
        available = min(pull.num_tokens, len(request.prompt_token_ids or ()))
        count = available - num_computed_tokens
        if count > 0:
            return count, True
        # This worker's own prefix cache holds all of it (the conductor's index lagged, and the
        # prefill pushed it anyway): the staged KV is freed now, not held until the staging TTL.
        self._unclaimed.append(pull.transfer_id)
        self._attempted.add(request.request_id)
        return 0, False

    def after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        pull = pull_of(request)
        if pull is None or num_external_tokens <= 0:
            return
        available = min(pull.num_tokens, len(request.prompt_token_ids or ()))
        local_tokens = available - num_external_tokens  # block-aligned local prefix-cache hit
        first = local_tokens // self._block_size
        last = blocks_for(available, self._block_size)
        block_ids = blocks.get_block_ids()[0]
        self._loads.append(LoadSpec(
            request_id=request.request_id, transfer_id=pull.transfer_id,
            block_ids=tuple(block_ids[first:last]), first_block=first,
            num_tokens=available, wait_timeout_s=pull.wait_timeout_s,
        ))
        self._attempted.add(request.request_id)

    def take(self) -> list[LoadSpec]:
        loads, self._loads = self._loads, []
        return loads

    def take_unclaimed(self) -> list[str]:
        """Transfer ids whose staged KV nobody will land (matched_tokens found nothing to load)."""
        unclaimed, self._unclaimed = self._unclaimed, []
        return unclaimed

    def finished(self, request_id: str) -> None:
        self._attempted.discard(request_id)
