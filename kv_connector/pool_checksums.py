"""The pool copier's checksums of the bytes it copies (kv_connector/pool_copier.py): a load's
running checksum of each block read out of the arena, checked before the forward uses it; a
save's running checksum of each block written in, which its commit names."""

from __future__ import annotations

import xxhash

from kv_connector.pool_planner import PoolLoad


class BlockReads:
    """Blocks a load read (pinned) from the pool, and the running checksum of the bytes copied
    out of each: a block changed in DRAM since it was committed is caught, never computed on."""

    def __init__(self, load: PoolLoad, got: list[tuple[int, int, int]]):
        self.keys = [k for k, _, _ in got]
        self.slots = [s for _, s, _ in got]
        self.expected = [c for _, _, c in got]
        self.block_ids = load.block_ids[:len(got)]
        self.digests = [xxhash.xxh3_64() for _ in got]

    def corrupt(self) -> list[int]:
        """Positions of the blocks whose copied bytes do not match their checksum (call once
        every layer is copied)."""
        return [i for i, (d, c) in enumerate(zip(self.digests, self.expected)) if d.intdigest() != c]


class SaveJob:
    """A save's layers still to copy, and the running checksum of each block's bytes as copied
    (layers in slot order make the block's checksum). The commit names these checksums, so a
    slot that anything else wrote into before the commit (a peer's transfer that arrived past
    its quarantine) fails every read instead of being committed as it stands."""

    def __init__(self, layers: int, blocks: int):
        self.layers_left = layers
        self.ok = True
        self.next_index = 0  # the layer the running checksums take next
        self.digests: list | None = [xxhash.xxh3_64() for _ in range(blocks)]

    def hash_layer(self, index: int, rows) -> None:
        """Feed layer `index`'s rows (one per block) to the checksums. Layers out of slot order
        leave the commit without checksums (the pool then hashes the slots itself)."""
        if self.digests is None:
            return
        if index != self.next_index:
            self.digests = None
            return
        for digest, row in zip(self.digests, rows):
            digest.update(row)
        self.next_index += 1

    def checksums(self) -> list[int] | None:
        return None if self.digests is None else [d.intdigest() for d in self.digests]
