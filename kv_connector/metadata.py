"""What the connector's scheduler half tells its worker half each step (vLLM pickles this)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from decode.load_planner import LoadSpec
from prefill.push_planner import SaveSpec


@dataclass
class ServeConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveSpec] = field(default_factory=list)  # producer: push these after this step
    loads: list[LoadSpec] = field(default_factory=list)  # consumer: land these
    unclaimed: list[str] = field(default_factory=list)  # consumer: free these transfers' staged KV (cached here)
    # producer: requests preempted this step whose earlier sends may still read their old blocks;
    # the worker waits for those sends before the forward may overwrite the blocks.
    preempted: set[str] = field(default_factory=set)
    # producer: (request id, transfer id) of pushes that carried KV computed over blocks that
    # failed to load: the worker fails them, even if every layer was acknowledged.
    invalidated: list[tuple[str, str]] = field(default_factory=list)
