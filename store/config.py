"""The block pool's configuration: one frozen dataclass, its defaults in mooncake/defaults.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mooncake import defaults


@dataclass(frozen=True)
class PoolConfig:
    """Sizes and policy of one node's KVCache pool.

    dram_bytes: the DRAM tier (a shared-memory arena of dram_bytes // block_bytes slots).
    ssd_dir:    the SSD tier's directory (created if missing); None = DRAM only.
    ssd_bytes:  the most bytes of block files the SSD tier keeps (headers not counted).
    policy:     eviction policy of both tiers, a name from store/policy.py ("lru", "fifo").
    block_bytes: bytes of one block, all layers. 0 = not known yet: the pool service takes it
                from the first connector that attaches (the engine's KV layout decides it).
    pin_lease_s: how long a peer's pins on blocks here last if it never releases them.
    reserve_lease_s: how long a reserved slot waits for its commit or abort before it is freed.
    map_same_host_peers: copy a same-host peer's blocks straight out of its arena
                (store/peer_arena.py); False: over the messenger, as from another host.
    ssd_shared_by: how many pools' SSD tiers start on ssd_dir's disk together (`mooncake serve`
                passes its worker count): at start this tier takes at most its share of the
                disk's free space (store/ssd.py, SsdTier.room_for_files), besides its own files.
    """

    dram_bytes: int = defaults.POOL_DRAM_BYTES
    ssd_dir: str | None = defaults.POOL_SSD_DIR
    ssd_bytes: int = defaults.POOL_SSD_BYTES
    policy: str = defaults.POOL_POLICY
    block_bytes: int = 0
    pin_lease_s: float = defaults.POOL_PIN_LEASE_S
    reserve_lease_s: float = defaults.POOL_RESERVE_LEASE_S
    map_same_host_peers: bool = True
    ssd_shared_by: int = 1

    def __post_init__(self) -> None:
        from store.policy import POLICIES  # the names live next to the policies

        sizes = (self.dram_bytes, self.ssd_bytes, self.block_bytes)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes):
            raise ValueError(f"pool sizes must be whole numbers of bytes >= 0 (dram_bytes={self.dram_bytes!r}, "
                             f"ssd_bytes={self.ssd_bytes!r}, block_bytes={self.block_bytes!r})")
        if not isinstance(self.ssd_shared_by, int) or isinstance(self.ssd_shared_by, bool) or self.ssd_shared_by < 1:
            raise ValueError(f"ssd_shared_by counts the pools sharing the SSD's disk: a whole number >= 1, "
                             f"got {self.ssd_shared_by!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown pool policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if self.block_bytes and self.dram_bytes and self.dram_bytes < self.block_bytes:
            raise ValueError(f"the pool's DRAM tier ({self.dram_bytes} B) cannot hold one block "
                             f"of {self.block_bytes} B; give it at least that, or 0 to turn the pool off")
        # NaN passed `<= 0`: every reservation was then expired at once, and two writers shared a slot.
        if not all(math.isfinite(s) and s > 0 for s in (self.pin_lease_s, self.reserve_lease_s)):
            raise ValueError(f"pin_lease_s and reserve_lease_s must be finite and > 0, got {self.pin_lease_s} "
                             f"and {self.reserve_lease_s}")

    @property
    def dram_slots(self) -> int:
        return self.dram_bytes // self.block_bytes if self.block_bytes else 0

    @property
    def ssd_slots(self) -> int:
        return self.ssd_bytes // self.block_bytes if self.block_bytes and self.ssd_dir else 0
