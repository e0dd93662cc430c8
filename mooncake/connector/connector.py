"""MooncakeConnector: our vLLM KV connector (loaded with `kv_connector_module_path`).

vLLM makes two instances: one in the scheduler (role SCHEDULER) and one per worker (role
WORKER). This class only routes each call to the half that owns it; the logic lives in
scheduler_side.py and worker_side.py. Every engine runs with kv_role "kv_both": whether a request
pushes, loads, or does neither is decided per request by its kv_transfer_params.

Settings come from `kv_connector_extra_config`:
  kv_host, kv_port        where this engine receives pushed KV (port 0 = any free port)
  staging_bytes           most pushed KV bytes held before the engine claims them
  staging_ttl_s           unclaimed pushes are dropped after this long
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from messenger.tcp import TcpConfig
from mooncake.connector.metadata import MooncakeConnectorMetadata
from mooncake.connector.scheduler_side import ConnectorScheduler
from mooncake.connector.staging import StagingConfig
from mooncake.connector.worker_side import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class MooncakeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        block_size = vllm_config.cache_config.block_size
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(block_size)
        else:
            self._worker = ConnectorWorker(
                host=str(extra.get("kv_host", "127.0.0.1")),
                port=int(extra.get("kv_port", 0)),
                block_size=block_size,
                staging=StagingConfig(
                    capacity_bytes=int(extra.get("staging_bytes", 4 << 30)),
                    ttl_s=float(extra.get("staging_ttl_s", 120.0)),
                ),
                tcp=TcpConfig(),
            )

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads land whole before the request is scheduled (async loading), so no layer waits.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        finished, failed = self._worker.collect_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    def _meta(self) -> MooncakeConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        return meta

    # -- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._scheduler is not None
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)
