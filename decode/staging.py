"""The decode side's landing area for pushed KV: whole layers, keyed by transfer id.

Layers arrive from the messenger's receiver threads and leave when the engine copies them into
its paged cache. Pure bookkeeping with an explicit clock; one lock, because receiver threads and
the engine's thread both touch it. Entries that nobody claims (the conductor died, the request was
aborted) expire after `ttl_s`, and a byte budget bounds the memory pushed at us.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StagingConfig:
    capacity_bytes: int = 4 << 30
    """Most KV bytes held at once; a push beyond it is refused (the sender reports it)."""
    ttl_s: float = 120.0
    """An unclaimed transfer is dropped this long after its first layer arrived."""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.ttl_s <= 0:
            raise ValueError("StagingConfig.capacity_bytes and ttl_s must be positive")


@dataclass
class StagedLayer:
    layer_name: str
    shape: tuple[int, ...]  # [num_blocks, ...] as the sender's paged cache holds one layer
    dtype: str
    data: bytearray


@dataclass
class StagedTransfer:
    transfer_id: str
    num_layers: int
    num_tokens: int
    created_at: float
    layers: dict[int, StagedLayer] = field(default_factory=dict)
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.error is None and len(self.layers) == self.num_layers

    @property
    def nbytes(self) -> int:
        return sum(len(layer.data) for layer in self.layers.values())


class StagingFull(RuntimeError):
    """Staging a transfer would pass the byte budget; the sender fails it and decode recomputes."""


class KVStaging:
    def __init__(self, config: StagingConfig = StagingConfig()):
        self._config = config
        self._lock = threading.Lock()
        self._transfers: dict[str, StagedTransfer] = {}
        self._bytes = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def put_layer(self, transfer_id: str, layer_index: int, num_layers: int, num_tokens: int,
                  layer: StagedLayer, now: float) -> None:
        with self._lock:
            if self._bytes + len(layer.data) > self._config.capacity_bytes:
                raise StagingFull(
                    f"staging holds {self._bytes} B of {self._config.capacity_bytes} B; "
                    f"refusing {len(layer.data)} B for {transfer_id}"
                )
            entry = self._transfers.get(transfer_id)
            if entry is None:
                entry = StagedTransfer(transfer_id, num_layers, num_tokens, created_at=now)
                self._transfers[transfer_id] = entry
            if not 0 <= layer_index < entry.num_layers:
                raise ValueError(f"layer {layer_index} out of range for {entry.num_layers} layers")
            old = entry.layers.get(layer_index)
            if old is not None:  # a resend after a broken connection replaces the layer
                self._bytes -= len(old.data)
            entry.layers[layer_index] = layer
            self._bytes += len(layer.data)

    def fail(self, transfer_id: str, error: str, now: float) -> None:
        """Mark a transfer broken (e.g. a checksum mismatch) so the consumer recomputes at once."""
        with self._lock:
            entry = self._transfers.setdefault(
                transfer_id, StagedTransfer(transfer_id, 0, 0, created_at=now)
            )
            entry.error = error

    def peek(self, transfer_id: str) -> StagedTransfer | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def pop(self, transfer_id: str) -> StagedTransfer | None:
        with self._lock:
            entry = self._transfers.pop(transfer_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            return entry

    def expire(self, now: float) -> list[str]:
        """Drop transfers older than the TTL; returns their ids."""
        with self._lock:
            old = [t for t, e in self._transfers.items() if now - e.created_at > self._config.ttl_s]
            for transfer_id in old:
                self._bytes -= self._transfers.pop(transfer_id).nbytes
            return old
