"""The consumer's data path, in vLLM's worker process: receive pushed KV and land it in the
paged cache.

A messenger server thread lands pushed layers in `KVStaging` after checking their checksum.
Each engine step, `collect_loads` copies complete transfers into the blocks the scheduler
allocated and reports them finished; a transfer that is broken or late is reported failed, and
vLLM recomputes that prompt locally (kv_load_failure_policy="recompute"): slower, never wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import torch
import xxhash

from decode.load_planner import LoadSpec
from decode.staging import KVStaging, StagedLayer, StagedTransfer, StagingConfig
from messenger.stats import TransportStats
from messenger.tcp import TcpConfig, TcpServer

# Under "vllm." so the messages show in vLLM's worker processes, whose logging vLLM configures.
log = logging.getLogger("vllm.mooncake." + __name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ReceiverStats:
    """Counters since start; served through the connector's control channel."""

    loaded_transfers: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    load_timeouts: int = 0
    checksum_failures: int = 0
    load_seconds: float = 0.0


@dataclass
class _PendingLoad:
    spec: LoadSpec
    deadline: float


class KVReceiver:
    def __init__(self, host: str, port: int, block_size: int, staging: StagingConfig, tcp: TcpConfig,
                 transport: TransportStats | None = None):
        self._block_size = block_size
        self._staging = KVStaging(staging)
        self._server = TcpServer(host, port, self._on_frame, tcp, transport)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._pending: dict[str, _PendingLoad] = {}
        self._stats = ReceiverStats()
        self._stats_lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.address

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}
        self._server.start()
        first = next(iter(self._kv_caches.values()))
        log.info("KV receiver: %d layers of %s %s on %s", len(self._kv_caches),
                 tuple(first.shape), first.dtype, self._server.address)

    def stats(self) -> dict:
        with self._stats_lock:
            return {**asdict(self._stats), "staged_bytes": self._staging.used_bytes}

    def drop(self, transfer_id: str) -> None:
        """The conductor will not decode this transfer here: free what was staged for it."""
        self._staging.pop(transfer_id)

    def shutdown(self) -> None:
        self._server.close()

    # -- receiving (messenger thread) ---------------------------------------------------------

    def _on_frame(self, header: dict, payload: bytearray) -> dict:
        if header.get("op") != "put":
            return {"ok": False, "error": f"the KV socket takes only 'put', not {header.get('op')!r}"}
        now = time.monotonic()
        transfer_id = header["transfer_id"]
        if xxhash.xxh3_64_hexdigest(payload) != header["xxh3"]:
            with self._stats_lock:
                self._stats.checksum_failures += 1
            self._staging.fail(transfer_id, f"checksum mismatch on layer {header['layer_index']}", now)
            return {"ok": False, "error": "checksum mismatch"}
        layer = StagedLayer(header["layer_name"], tuple(header["shape"]), header["dtype"], payload)
        self._staging.put_layer(transfer_id, int(header["layer_index"]), int(header["num_layers"]),
                                int(header["num_tokens"]), layer, now)
        return {"ok": True}

    # -- landing (engine thread) --------------------------------------------------------------

    def start_load_kv(self, loads: list[LoadSpec]) -> None:
        now = time.monotonic()
        for spec in loads:
            self._pending[spec.request_id] = _PendingLoad(spec, deadline=now + spec.wait_timeout_s)

    def collect_loads(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Land complete transfers; returns (finished, failed) request ids. Failed ones are also
        finished, as vLLM requires, so the scheduler releases them to recompute."""
        now = time.monotonic()
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id in finished_req_ids & self._pending.keys():  # aborted while waiting
            self._staging.pop(self._pending.pop(req_id).spec.transfer_id)
        for req_id, pending in list(self._pending.items()):
            staged = self._staging.peek(pending.spec.transfer_id)
            error = None
            if staged is not None and staged.error is not None:
                error = staged.error
            elif staged is not None and staged.complete:
                error = self._land(pending.spec, staged)
            elif now < pending.deadline:
                continue
            else:
                error = f"no KV after {pending.spec.wait_timeout_s:.1f} s"
                with self._stats_lock:
                    self._stats.load_timeouts += 1
            self._staging.pop(pending.spec.transfer_id)
            del self._pending[req_id]
            finished.add(req_id)
            if error is not None:
                log.warning("KV load for %s failed (%s); recomputing its prompt", req_id, error)
                failed.add(req_id)
                with self._stats_lock:
                    self._stats.load_failures += 1
        for transfer_id in self._staging.expire(now):
            log.warning("dropped unclaimed KV transfer %s after its TTL", transfer_id)
        return finished, failed

    def _land(self, spec: LoadSpec, staged: StagedTransfer) -> str | None:
        """Copy a staged transfer into the paged cache; returns an error string or None."""
        start = time.perf_counter()
        if staged.num_layers != len(self._kv_caches):
            return f"sender has {staged.num_layers} layers, this engine {len(self._kv_caches)}"
        nbytes = 0
        for name, index in self._layer_index.items():
            layer = staged.layers[index]
            cache = self._kv_caches[name]
            dtype = _DTYPES.get(layer.dtype)
            if layer.layer_name != name or dtype != cache.dtype or tuple(layer.shape[1:]) != tuple(cache.shape[1:]):
                return (f"layout mismatch on {name}: got {layer.layer_name} {layer.shape} {layer.dtype}, "
                        f"expected {tuple(cache.shape[1:])} {cache.dtype}")
            rows = torch.frombuffer(layer.data, dtype=dtype).view(layer.shape)
            wanted = rows[spec.first_block: spec.first_block + len(spec.block_ids)]
            if wanted.shape[0] != len(spec.block_ids):
                return f"sender pushed {layer.shape[0]} blocks, {spec.first_block + len(spec.block_ids)} needed"
            ids = torch.tensor(spec.block_ids, dtype=torch.long, device=cache.device)
            cache.index_copy_(0, ids, wanted.to(cache.device))
            nbytes += wanted.numel() * wanted.element_size()
        with self._stats_lock:
            self._stats.loaded_transfers += 1
            self._stats.loaded_tokens += spec.num_tokens - spec.first_block * self._block_size
            self._stats.loaded_bytes += nbytes
            self._stats.load_seconds += time.perf_counter() - start
        return None
