"""The producer's data path, in vLLM's worker process: copy a prompt's blocks out of the paged
cache and push them to the decode worker through the messenger.

`save_kv_layer` copies one layer's prompt blocks (one index_select, no per-token work) and hands
them to a sender thread, so layer i travels while layer i+1 computes. `wait_for_save` returns
once every layer of the step has been acknowledged, so the blocks may be freed and the prefill's
answer means "the KV has landed". A push that fails is counted and logged; the decode side then
times out or sees a broken transfer and recomputes (never wrong text).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
import xxhash

from messenger.stats import TransportStats
from messenger.tcp import TcpClient, TcpConfig
from prefill.push_planner import SaveSpec

# Under "vllm." so the messages show in vLLM's worker processes, whose logging vLLM configures.
log = logging.getLogger("vllm.mooncake." + __name__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class SenderStats:
    """Counters since start; served through the connector's control channel."""

    pushed_transfers: int = 0
    pushed_bytes: int = 0
    push_failures: int = 0
    push_seconds: float = 0.0


class KVSender:
    def __init__(self, tcp: TcpConfig, transport: TransportStats | None = None):
        self._client = TcpClient(tcp, transport)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-push")
        self._layer_index: dict[str, int] = {}
        self._in_flight: list[tuple[SaveSpec, Future]] = []
        self._stats = SenderStats()
        self._stats_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def stats(self) -> dict:
        with self._stats_lock:
            return asdict(self._stats)

    def shutdown(self) -> None:
        self._sender.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def save_kv_layer(self, saves: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        if not saves:
            return
        index = self._layer_index[layer_name]
        for spec in saves:
            ids = torch.tensor(spec.block_ids, dtype=torch.long, device=kv_layer.device)
            rows = kv_layer.index_select(0, ids).cpu().contiguous()
            future = self._sender.submit(self._push_layer, spec, index, layer_name, rows)
            self._in_flight.append((spec, future))

    def wait_for_save(self) -> None:
        failed: dict[str, str] = {}
        for spec, future in self._in_flight:
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - any failure of a push is reported the same way
                failed[spec.transfer_id] = f"{type(exc).__name__}: {exc}"
        self._in_flight.clear()
        for transfer_id, error in failed.items():
            log.error("KV push %s failed: %s (decode will recompute the prompt)", transfer_id, error)
            with self._stats_lock:
                self._stats.push_failures += 1

    def _push_layer(self, spec: SaveSpec, index: int, layer_name: str, rows: torch.Tensor) -> None:
        start = time.perf_counter()
        payload = rows.view(torch.uint8).numpy() if rows.dtype != torch.bfloat16 else rows.view(torch.int16).numpy()
        header = {
            "op": "put", "transfer_id": spec.transfer_id, "layer_index": index,
            "num_layers": len(self._layer_index), "layer_name": layer_name,
            "num_tokens": spec.num_tokens, "shape": list(rows.shape), "dtype": dtype_name(rows.dtype),
            "xxh3": xxhash.xxh3_64_hexdigest(payload),
        }
        self._client.request(spec.dest, header, payload)
        with self._stats_lock:
            self._stats.pushed_bytes += payload.nbytes
            self._stats.push_seconds += time.perf_counter() - start
            if index == len(self._layer_index) - 1:
                self._stats.pushed_transfers += 1
