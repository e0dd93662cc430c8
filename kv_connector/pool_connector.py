"""MooncakePoolConnector: the node's KVCache pool (store/) inside every engine.

A second connector beside MooncakeServeConnector, composed with it by vLLM's MultiConnector
(mooncake/engine/engine.py lists ours first, this one second):

- get_num_new_matched_tokens: MultiConnector asks both and takes the first that offers tokens, so
  a decode request pulling its prompt from a prefill worker is the serve connector's; this one
  declines such requests outright (pool_planner.py) and offers the pool's prefix to every other.
- update_state_after_alloc: the chosen connector gets the external token count, the other 0.
- start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save: both, in order; the serve
  connector's behaviour is unchanged (it sees its own metadata only).
- request_finished: MultiConnector keeps the blocks if either connector asks (this one does while
  its saves are in flight); the serve connector never does, so there is no second async save.
  Its kv_transfer_params (merged by MultiConnector, handed to the worker on the last output) say
  how many prompt tokens came from the pool (LOADED_TOKENS_KEY).
- get_transfer_results: finished sending/receiving and failures of both are merged.

Settings come from `kv_connector_extra_config`:
  pool_path, pool_key   the pool service's channel in the worker shell (kv_connector/pool_client.py)
  pool_timeout_s        bound on one call from vLLM's scheduler (a slow pool is a cache miss)
  pool_load_timeout_s   bound on a load from SSD or another node
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kv_connector.model_identity import model_identity_of
from kv_connector.pool_copier import PoolCopier
from kv_connector.pool_planner import PoolLoad, PoolPlanner, PoolSave
from mooncake.kv_layout import num_blocks_of
from mooncake.control import ControlEndpoint
from mooncake.protocol import LOADED_TOKENS_KEY
from store.channel import PoolClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    loads: list[PoolLoad] = field(default_factory=list)
    saves: list[PoolSave] = field(default_factory=list)
    flush: tuple[str, ...] = ()  # preempted requests whose saves must land before this step


class MooncakePoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._num_blocks = lambda: num_blocks_of(vllm_config, kv_cache_config)  # known once caches exist
        extra = self._kv_transfer_config.kv_connector_extra_config
        endpoint = ControlEndpoint(str(extra["pool_path"]), str(extra["pool_key"]))
        timeout_s = float(extra.get("pool_timeout_s", 2.0))
        block_size = vllm_config.cache_config.block_size
        self._planner: PoolPlanner | None = None
        self._copier: PoolCopier | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = PoolPlanner(PoolClient(endpoint, timeout_s), block_size)
        else:
            self._copier = PoolCopier(lambda t: PoolClient(endpoint, t), block_size, timeout_s,
                                      load_timeout_s=float(extra.get("pool_load_timeout_s", 30.0)),
                                      model_id=model_identity_of(vllm_config.model_config))

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._copier is not None
        self._copier.register_kv_caches(kv_caches, self._num_blocks())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._copier is not None and isinstance(kv_connector_metadata, PoolConnectorMetadata)
        if kv_connector_metadata.flush:
            self._copier.flush(kv_connector_metadata.flush)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._copier is not None
        self._copier.start_loads(self._meta().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._copier is not None
        self._copier.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        assert self._copier is not None
        self._copier.save_layer(self._meta().saves, layer_name)

    def wait_for_save(self) -> None:
        return  # saves complete off the critical path; finished requests wait in get_transfer_results

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._copier is not None
        finished, failed = self._copier.collect_loads()
        return KVConnectorTransferResults(finished_sending=self._copier.finished_saving(finished_req_ids),
                                          finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._copier is not None
        return self._copier.take_invalid_blocks()

    def shutdown(self) -> None:
        if self._copier is not None:
            self._copier.shutdown()

    def _meta(self) -> PoolConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PoolConnectorMetadata)
        return meta

    # -- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._planner is not None
        self._planner.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None
        return self._planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._planner is not None
        loads, saves, flush = self._planner.plan(scheduler_output)
        return PoolConnectorMetadata(loads=loads, saves=saves, flush=flush)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        keep, loaded = self._planner.finished(request)
        # Reported so that the conductor does not take this prefill's time for compute alone.
        return keep, ({LOADED_TOKENS_KEY: loaded} if loaded else None)
