"""The decode side's landing area for pushed KV: one pre-allocated arena, carved per transfer.

The arena is allocated once (never per frame, never zeroed) and registered with the transfer
engine, so the prefill writes a transfer's layers straight into it. A transfer is reserved whole
when its first bytes are about to be sent (`reserve`, from the prefill's `engine.call`), laid out
as [layer][block][one block's bytes] for its blocks [first_block, first_block + num_blocks), and
its slot is given back when the engine copied it into the paged cache, or it failed, or nothing
happened to it (no reservation, no landed layer) for `ttl_s`. The slot of a transfer that ended
before all its bytes arrived is held back for another `ttl_s` first: the prefill may still be
writing into it, and those late bytes must not land in the next transfer's slot.

The consumer `claim`s a complete (or failed) transfer before it copies from its slot: the entry
leaves the table, so a drop, a new reservation of the same id or the TTL cannot free the slot
under the copy; `release` gives the slot back after it. A transfer that expired leaves a
tombstone (an entry that failed, without a slot) for another `ttl_s`, so a pull that comes later
fails at once instead of waiting out its timeout.

A transfer id reserved again is a new producer (the conductor retried a failed prefill on another
instance under the same request id): it gets a fresh slot, shaped by its own request, and the old
slot is held back as above. Each landing note names the slot it was written to, so the old
producer's late notes count for nothing, and a block is counted once however often it lands.

Pure bookkeeping with an explicit clock and one lock: the engine's receive threads, the control
thread and the engine's own thread all touch it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger("vllm.mooncake." + __name__)

ALIGN = 4096  # slots start on page boundaries (a GPU or NIC registration likes them there)


@dataclass(frozen=True)
class StagingConfig:
    capacity_bytes: int = 4 << 30
    """Size of the arena: most KV bytes held at once; a reservation beyond it is refused."""
    ttl_s: float = 120.0
    """An unclaimed transfer is dropped this long after it was reserved or a layer of it last landed."""
    pin_for_cuda: bool = True
    """Page-lock the arena when the KV caches are on a GPU (host-to-device copies then run at
    the bus's speed; it commits the whole arena's memory at start)."""

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.ttl_s <= 0:
            raise ValueError("StagingConfig.capacity_bytes and ttl_s must be positive")


class StagingFull(RuntimeError):
    """No room for a transfer; the prefill fails the push and decode recomputes."""


class Arena:
    """First-fit allocator of byte ranges in [0, capacity). Not thread-safe (KVStaging locks)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (offset, length), sorted, coalesced
        self.used = 0

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, length - size)
                self.used += size
                return offset
        raise StagingFull(f"staging holds {self.used} B of {self.capacity} B; no room for {nbytes} B")

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        self.used -= size
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # Coalesce with the right then the left neighbour.
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])


@dataclass
class StagedTransfer:
    transfer_id: str
    num_layers: int
    first_block: int
    num_blocks: int
    block_bytes: int  # one block of one layer
    offset: int  # of layer 0, block first_block, in the arena; -1: none (released, a tombstone, a failure)
    active_at: float  # reserved, or a layer last landed: the TTL counts from here (a long push is alive)
    landed: list[int] = field(default_factory=list)  # distinct blocks landed per layer
    error: str | None = None
    _seen: list[bytearray] = field(default_factory=list, repr=False)  # per layer, per block: landed

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes

    @property
    def complete(self) -> bool:
        return self.error is None and all(n >= self.num_blocks for n in self.landed)

    def mark(self, layer: int, first_block: int, end_block: int) -> None:
        """Blocks [first_block, end_block) of `layer` landed; one landed twice counts once."""
        seen = self._seen[layer]
        for i in range(first_block - self.first_block, end_block - self.first_block):
            if not seen[i]:
                seen[i] = 1
                self.landed[layer] += 1

    def layer_offset(self, layer: int) -> int:
        return self.offset + layer * self.num_blocks * self.block_bytes

    def block_offset(self, layer: int, block: int) -> int:
        """Where prompt block `block` (absolute index) of `layer` lives in the arena."""
        return self.layer_offset(layer) + (block - self.first_block) * self.block_bytes


class KVStaging:
    def __init__(self, config: StagingConfig = StagingConfig()):
        self._config = config
        self._lock = threading.Lock()
        self._arena = Arena(config.capacity_bytes)
        self._transfers: dict[str, StagedTransfer] = {}
        self._quarantine: list[tuple[float, int, int]] = []  # (reusable at, offset, nbytes)

    @property
    def capacity_bytes(self) -> int:
        return self._config.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._arena.used

    def reserve(self, transfer_id: str, num_layers: int, first_block: int, num_blocks: int, block_bytes: int,
                now: float) -> StagedTransfer:
        """Room for a whole transfer. Reserving an id again starts it over in a fresh slot (a new
        producer); the old slot is held back from the old producer's late bytes."""
        if num_layers <= 0 or first_block < 0 or num_blocks < 0 or block_bytes <= 0:
            raise ValueError(f"bad reservation for {transfer_id}: {num_layers} layers, blocks "
                             f"[{first_block}, +{num_blocks}), {block_bytes} B per block")
        with self._lock:
            size = num_layers * num_blocks * block_bytes
            try:
                offset = self._arena.alloc(size)  # before the old slot goes: never the same offset
            except StagingFull:
                # Expiry runs at engine steps, and an idle decode worker does not step: what
                # expired since (abandoned transfers, quarantined slots) is freed here first.
                for expired in self._expire_locked(now):
                    log.warning("dropped unclaimed KV transfer %s after its TTL, to make room", expired)
                offset = self._arena.alloc(size)
            old = self._transfers.get(transfer_id)
            if old is not None:
                self._release(old, now)
            entry = StagedTransfer(transfer_id, num_layers, first_block, num_blocks, block_bytes, offset=offset,
                                   active_at=now, landed=[0] * num_layers,
                                   _seen=[bytearray(num_blocks) for _ in range(num_layers)])
            self._transfers[transfer_id] = entry
            return entry

    def landed(self, transfer_id: str, layer: int, first_block: int, end_block: int, now: float,
               slot: int = -1) -> None:
        """Blocks [first_block, end_block) of `layer` are in the arena (verified by the engine).
        `slot`: the offset the producer was given (-1: not named, as KVLayerNote's); a note for
        another slot (an earlier producer of the same id) raises KeyError."""
        with self._lock:
            entry = self._transfers.get(transfer_id)
            if entry is None:
                raise KeyError(f"no reservation for transfer {transfer_id}")
            if entry.offset < 0:  # expired, or failed before it was reserved
                raise KeyError(f"transfer {transfer_id} holds no slot: {entry.error}")
            if slot >= 0 and slot != entry.offset:
                raise KeyError(f"transfer {transfer_id} was reserved again: a note for its old slot {slot}")
            if not (0 <= layer < entry.num_layers
                    and entry.first_block <= first_block <= end_block <= entry.first_block + entry.num_blocks):
                raise ValueError(f"layer {layer} blocks [{first_block}, {end_block}) outside transfer "
                                 f"{transfer_id} ({entry.num_layers} layers, blocks [{entry.first_block}, "
                                 f"{entry.first_block + entry.num_blocks}))")
            entry.mark(layer, first_block, end_block)
            entry.active_at = now

    def fail(self, transfer_id: str, error: str, now: float, slot: int = -1) -> None:
        """Mark a transfer broken (a checksum mismatch, a dead peer) so the consumer recomputes at
        once. `slot`: as for landed; a failure of an earlier producer's slot is ignored."""
        with self._lock:
            entry = self._transfers.get(transfer_id)
            if entry is None:
                entry = StagedTransfer(transfer_id, 0, 0, 0, 1, offset=-1, active_at=now)
                self._transfers[transfer_id] = entry
            elif slot >= 0 and slot != entry.offset and entry.offset >= 0:
                return
            entry.error = entry.error or error

    def peek(self, transfer_id: str) -> StagedTransfer | None:
        with self._lock:
            return self._transfers.get(transfer_id)

    def claim(self, transfer_id: str) -> StagedTransfer | None:
        """Take a complete or failed transfer out of the table for the consumer; None while it is
        still arriving (or unknown). Its slot stays reserved, whatever a drop, a new reservation of
        the id or the TTL do meanwhile, until `release`: the consumer copies from it outside the lock."""
        with self._lock:
            entry = self._transfers.get(transfer_id)
            if entry is None or not (entry.complete or entry.error is not None):
                return None
            return self._transfers.pop(transfer_id)

    def release(self, entry: StagedTransfer, now: float) -> None:
        """Give a claimed transfer's slot back (its bytes were copied out, or it failed)."""
        with self._lock:
            self._release(entry, now)

    def pop(self, transfer_id: str, now: float) -> StagedTransfer | None:
        """Forget a transfer and give its slot back (call it after its bytes were copied out)."""
        with self._lock:
            entry = self._transfers.pop(transfer_id, None)
            if entry is not None:
                self._release(entry, now)
            return entry

    def expire(self, now: float) -> list[str]:
        """Drop transfers idle for longer than the TTL; returns the ids of those that held a slot.
        Each leaves a tombstone for another TTL (a pull of it fails at once, no wait for a
        timeout); a tombstone, or a failure without a slot, is then forgotten."""
        with self._lock:
            return self._expire_locked(now)

    def _expire_locked(self, now: float) -> list[str]:
        """expire's work; the caller holds the lock."""
        idle = [t for t, e in self._transfers.items() if now - e.active_at > self._config.ttl_s]
        expired = []
        for transfer_id in idle:
            entry = self._transfers.pop(transfer_id)
            if entry.offset < 0:
                continue
            expired.append(transfer_id)
            self._release(entry, now)
            error = entry.error or f"dropped: nothing happened to it for {self._config.ttl_s:g} s (staging TTL)"
            self._transfers[transfer_id] = StagedTransfer(transfer_id, 0, 0, 0, 1, offset=-1, active_at=now,
                                                          error=error)
        held = [q for q in self._quarantine if q[0] > now]
        for _, offset, nbytes in (q for q in self._quarantine if q[0] <= now):
            self._arena.free(offset, nbytes)
        self._quarantine = held
        return expired

    def _release(self, entry: StagedTransfer, now: float) -> None:
        if entry.offset < 0:
            return
        if all(n >= entry.num_blocks for n in entry.landed):  # every byte is in: nothing more comes
            self._arena.free(entry.offset, entry.nbytes)
        else:
            self._quarantine.append((now + self._config.ttl_s, entry.offset, entry.nbytes))
        entry.offset = -1
