"""What the connector's scheduler half tells its worker half each step (vLLM pickles this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class SaveSpec:
    """Push the KV of `block_ids` (all blocks holding the prompt) to `dest` once this step ends."""

    request_id: str
    transfer_id: str
    dest: str
    block_ids: tuple[int, ...]
    num_tokens: int


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


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
