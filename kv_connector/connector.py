"""MooncakeServeConnector: the class vLLM loads (`kv_connector_module_path`).

vLLM makes two instances: one in the scheduler (role SCHEDULER) and one per worker (role
WORKER). This class only composes and routes: the producer half lives in prefill/ (push_planner,
kv_sender), the consumer half in decode/ (load_planner, kv_receiver). Whether a request pushes,
loads, or does neither is decided per request by its kv_transfer_params.

Settings come from `kv_connector_extra_config`:
  kv_host, kv_port            the transfer engine's tcp address (port 0 = any free port)
  kv_advertise_host           what it publishes when kv_host is 0.0.0.0 (default: the hostname's address)
  control_path, control_key   the control channel to the worker shell (mooncake/control.py)
  kv_auth_key                 hex key every KV connection must prove (absent: no handshake)
  staging_bytes               size of the staging arena pushed KV lands in
  staging_ttl_s               an unclaimed push is dropped after this long without a landed layer
  kv_timeout_s                a batch (or a call) to a peer not complete by then fails
  kv_transports               comma-separated transports to allow, in order of preference (default:
                              defaults.KV_TRANSPORTS; env MOONCAKE_KV_TRANSPORTS, e.g. "tcp" to force tcp)
  kv_fault_flip               TEST ONLY (default 0; env MOONCAKE_KV_FAULT_FLIP): flip one byte on the wire
                              in the next N written batches (kv_connector/fault.py), to show a corrupt
                              slice fails the load and decode recomputes
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from decode.kv_receiver import KVReceiver
from decode.load_planner import LoadPlanner
from decode.staging import StagingConfig
from kv_connector.metadata import ServeConnectorMetadata
from kv_connector.fault import flip_bytes_on_the_wire
from messenger.engine import EngineConfig, TransferEngine
from messenger.rdma_plan import RdmaConfig
from mooncake import defaults
from mooncake.kv_layout import num_blocks_of
from mooncake.control import ControlEndpoint, ControlServer
from prefill.kv_sender import KVSender
from prefill.push_planner import PushPlanner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MooncakeServeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._num_blocks = lambda: num_blocks_of(vllm_config, kv_cache_config)  # known once caches exist
        extra = self._kv_transfer_config.kv_connector_extra_config
        block_size = vllm_config.cache_config.block_size
        self._pushes: PushPlanner | None = None
        self._loads: LoadPlanner | None = None
        self._sender: KVSender | None = None
        self._receiver: KVReceiver | None = None
        self._control: ControlServer | None = None
        self._engine = None
        self._invalidated: list[tuple[str, str]] = []  # scheduler: pushes to fail, for the next metadata
        if role == KVConnectorRole.SCHEDULER:
            self._pushes, self._loads = PushPlanner(block_size), LoadPlanner(block_size)
            return
        # With a cluster token, every KV connection proves a key derived from it (messenger/handshake.py).
        auth_key = extra.get("kv_auth_key")
        timeout_s = float(extra.get("kv_timeout_s", defaults.KV_TRANSFER_TIMEOUT_S))
        transports = defaults.kv_transports(extra.get("kv_transports"))
        config = EngineConfig(host=str(extra.get("kv_host", "127.0.0.1")), port=int(extra.get("kv_port", 0)),
                              advertise_host=extra.get("kv_advertise_host") or None,
                              timeout_s=timeout_s, auth_key=bytes.fromhex(auth_key) if auth_key else None,
                              transports=transports, rdma=RdmaConfig.from_env() if "rdma" in transports else None)
        self._engine = TransferEngine(f"kv-{socket.gethostname()}-{os.getpid()}", config)
        self._fault_flip = int(extra.get("kv_fault_flip") or os.environ.get("MOONCAKE_KV_FAULT_FLIP", 0))
        self._sender = KVSender(self._engine, timeout_s=timeout_s)
        self._receiver = KVReceiver(
            self._engine, block_size=block_size,
            staging=StagingConfig(capacity_bytes=int(extra.get("staging_bytes", 4 << 30)),
                                  ttl_s=float(extra.get("staging_ttl_s", 120.0))),
        )
        if extra.get("control_path"):
            endpoint = ControlEndpoint(str(extra["control_path"]), str(extra["control_key"]))
            self._control = ControlServer(endpoint, self._on_control)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._sender is not None and self._receiver is not None
        num_blocks = self._num_blocks()
        self._sender.register_kv_caches(kv_caches, num_blocks)
        self._receiver.register_kv_caches(kv_caches, num_blocks)
        self._engine.start(on_notify=self._receiver.on_notify, on_call=self._receiver.on_call)
        flip_bytes_on_the_wire(self._engine, self._fault_flip)  # TEST ONLY; 0 (off) unless a test sets it
        if self._control is not None:
            self._control.start()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward may overwrite a preempted request's freed blocks: the sends
        # still reading them must be done (bounded by the engine's timeout; a late one fails).
        assert self._sender is not None
        if not isinstance(kv_connector_metadata, ServeConnectorMetadata):
            return
        if kv_connector_metadata.preempted:
            self._sender.settle(kv_connector_metadata.preempted)
        for request_id, transfer_id in kv_connector_metadata.invalidated:
            self._sender.invalidate(request_id, transfer_id, "blocks it pushed were computed over KV that failed to "
                                                             "load from the pool (vLLM recomputes them)")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._receiver is not None
        meta = self._meta()
        for transfer_id in meta.unclaimed:
            self._receiver.drop(transfer_id)
        self._receiver.start_load_kv(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads land whole before the request is scheduled (async loading), so no layer waits.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        assert self._sender is not None
        self._sender.save_kv_layer(self._meta().saves, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self._sender is not None
        self._sender.wait_for_save()  # returns at once: blocks are freed late (finished_sending)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._receiver is not None and self._sender is not None
        finished, failed = self._receiver.collect_loads(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=self._sender.finished_sending(finished_req_ids),
                                          finished_recving=finished, failed_recving=failed)

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
        if self._receiver is not None:
            self._receiver.shutdown()
        if self._sender is not None:
            self._sender.shutdown()
        if self._engine is not None:
            self._engine.close()

    def _meta(self) -> ServeConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ServeConnectorMetadata)
        return meta

    def _on_control(self, request: dict) -> dict:
        """Control calls from the worker shell (never on the KV data socket)."""
        assert self._sender is not None and self._receiver is not None
        op = request.get("op")
        if op == "stats":
            stats = {**self._sender.stats(), **self._receiver.stats()}
            return {"ok": True, "stats": stats, "staged_bytes": stats.pop("staged_bytes"),
                    "messenger": self._engine.stats(), "layer_timeline": self._sender.timeline()}
        if op == "push_outcome":  # the shell, before it answers a prefill that pushed
            outcome = self._sender.outcome(str(request.get("transfer_id")), float(request.get("timeout_s", 10.0)))
            if outcome == "ok":
                return {"ok": True}
            return {"ok": False, "error": outcome or f"the push was not acknowledged within {request.get('timeout_s')} s"}
        if op == "drop":
            self._receiver.drop(str(request.get("transfer_id")))
            return {"ok": True}
        return {"ok": False, "error": f"unknown control op {op!r}"}

    # -- scheduler side -----------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        assert self._pushes is not None
        self._pushes.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._loads is not None
        return self._loads.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._pushes is not None and self._loads is not None
        self._pushes.after_alloc(request)
        self._loads.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._pushes is not None and self._loads is not None
        invalidated, self._invalidated = self._invalidated, []
        return ServeConnectorMetadata(saves=self._pushes.plan(scheduler_output), loads=self._loads.take(),
                                      unclaimed=self._loads.take_unclaimed(),
                                      preempted=self._pushes.preempted(scheduler_output.preempted_req_ids),
                                      invalidated=invalidated)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        # Blocks another connector (the pool) failed to load in the last step: pushes that
        # already carried KV computed over them must fail (told to the worker in the next step's
        # metadata, before the recompute can finish the request).
        assert self._pushes is not None
        self._invalidated += self._pushes.invalid_blocks(connector_output.invalid_block_ids)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._pushes is not None and self._loads is not None
        self._loads.finished(request.request_id)
        # True: the worker still sends from these blocks; vLLM frees them once it reports the
        # request in finished_sending (vLLM's delayed free), so no step waits for acknowledgements.
        return self._pushes.finished(request.request_id), None
