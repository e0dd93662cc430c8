"""Global prefix index: which instance holds which prefix block.

Each block key maps to a bitmask of instance slots. The longest cached prefix of every
instance for a prompt is one walk down the prompt's keys, AND-ing masks: an instance drops
out at the first block it lacks, so the walk records its prefix length then and stops once
nobody is left. A 1,024-instance mask is a 16-word Python int, so the AND is cheap and the
walk costs one dict lookup per block, independent of the number of instances. Memory: one int per indexed block (about 10^6 blocks -> ~150 MB with 128-bit keys).

The index is the one mutable part of the core's input: the shell applies the stores'
"stored"/"removed" events to it in order; the scheduler only reads it.

Tiers: a block an instance holds only in its KVCache pool (evicted from the engine's own cache)
must be loaded before it is reused, which costs time by tier. Such blocks carry their fastest
tier ("dram", "ssd") per instance beside the masks; a block with none is in the engine (free).
Only pool-only blocks are kept there, so an index without pools costs nothing more.

PendingPrefixes is its companion for blocks not stored yet: the shell adds a prompt's blocks
to the instance it dispatches the prefill to, and discards them when that prefill ends.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat
from operator import and_


_CHUNK = 256  # blocks per accumulate() pass in match()


class EventKind(enum.StrEnum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A store's report that instance_id now holds (or dropped) these blocks."""

    kind: EventKind
    instance_id: str
    block_hashes: tuple[Hashable, ...]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Block key -> set of holders, as bitmasks over instance slots.

    Mutated only by apply/apply_stored/apply_removed/remove_instance; never blocks.
    """

    def __init__(self) -> None:
        self._masks: dict[Hashable, int] = {}
        self._slot_of: dict[str, int] = {}
        self._id_of: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._block_count: dict[str, int] = {}
        self._pool_tier: dict[str, dict[Hashable, str]] = {}  # instance -> pool-only block -> its tier

    # -- events ---------------------------------------------------------------------------

    def _slot(self, instance_id: str) -> int:
        slot = self._slot_of.get(instance_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot_of)
            self._slot_of[instance_id] = slot
            self._id_of[slot] = instance_id
            self._block_count[instance_id] = 0
        return slot

    def apply(self, event: KVEvent) -> None:
        if event.kind is EventKind.STORED:
            self.apply_stored(event.instance_id, event.block_hashes)
        else:
            self.apply_removed(event.instance_id, event.block_hashes)

    def apply_stored(self, instance_id: str, block_hashes: Iterable[Hashable],
                     pool_tiers: Mapping[Hashable, str] | None = None) -> None:
        """The instance holds these blocks now. pool_tiers: the fastest tier of those held only in
        its KVCache pool; every other one listed is in its engine (stored again: it moved there)."""
        bit = 1 << self._slot(instance_id)
        masks = self._masks
        added = 0
        tiers = self._pool_tier.get(instance_id)
        for h in block_hashes:
            old = masks.get(h, 0)
            if not old & bit:
                masks[h] = old | bit
                added += 1
            if pool_tiers and h in pool_tiers:
                if tiers is None:
                    tiers = self._pool_tier[instance_id] = {}
                tiers[h] = pool_tiers[h]
            elif tiers:
                tiers.pop(h, None)
        self._block_count[instance_id] += added

    def apply_removed(self, instance_id: str, block_hashes: Iterable[Hashable]) -> None:
        slot = self._slot_of.get(instance_id)
        if slot is None:
            return  # removal from an instance we never heard of: nothing to undo
        bit = 1 << slot
        masks = self._masks
        removed = 0
        tiers = self._pool_tier.get(instance_id)
        for h in block_hashes:
            if tiers:
                tiers.pop(h, None)
            old = masks.get(h, 0)
            if old & bit:
                new = old & ~bit
                if new:
                    masks[h] = new
                else:
                    del masks[h]
                removed += 1
        self._block_count[instance_id] -= removed

    def remove_instance(self, instance_id: str) -> None:
        """Forget a dead instance. O(index size); instances leave rarely."""
        slot = self._slot_of.pop(instance_id, None)
        if slot is None:
            return
        bit = 1 << slot
        masks = self._masks
        for h in [h for h, m in masks.items() if m & bit]:
            new = masks[h] & ~bit
            if new:
                masks[h] = new
            else:
                del masks[h]
        del self._id_of[slot]
        del self._block_count[instance_id]
        self._pool_tier.pop(instance_id, None)
        self._free_slots.append(slot)

    # -- queries --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._masks)

    def instances(self) -> list[str]:
        return list(self._slot_of)

    def block_count(self, instance_id: str) -> int:
        return self._block_count.get(instance_id, 0)

    def pool_only_blocks(self, instance_id: str, block_hashes: Sequence[Hashable], n: int) -> dict[str, int]:
        """Of the first n blocks (an instance's matched prefix), how many it holds only in its
        pool, by tier; empty when all are in its engine."""
        tiers = self._pool_tier.get(instance_id)
        counts: dict[str, int] = {}
        if tiers:
            for h in islice(block_hashes, n):
                tier = tiers.get(h)
                if tier is not None:
                    counts[tier] = counts.get(tier, 0) + 1
        return counts

    def holders(self, block_hash: Hashable) -> frozenset[str]:
        return frozenset(self._id_of[s] for s in _bits(self._masks.get(block_hash, 0)))

    def holds(self, instance_id: str, block_hash: Hashable) -> bool:
        slot = self._slot_of.get(instance_id)
        return slot is not None and bool(self._masks.get(block_hash, 0) >> slot & 1)

    def match(self, block_hashes: Sequence[Hashable]) -> dict[str, int]:
        """Longest cached prefix, in blocks, of every instance that holds at least block 0.

        Instances absent from the result hold no prefix of this prompt. The running AND of
        the masks is computed at C speed (accumulate), a chunk of blocks at a time so a walk
        whose holders all drop out early stops early. It only shrinks, so each place where it
        changes is found by binary search, and there are at most as many as holders.
        """
        n = len(block_hashes)
        id_of, get = self._id_of, self._masks.get
        result: dict[str, int] = {}
        alive = -1  # all ones: nobody has dropped out before block 0
        for base in range(0, n, _CHUNK):
            chunk = block_hashes[base:base + _CHUNK]
            acc = list(accumulate(map(get, chunk, repeat(0, len(chunk))), and_, initial=alive))
            # acc[k] is the AND over blocks [0, base + k); acc[0] is the carried-in mask.
            i, m = 0, len(acc) - 1
            while i < m and acc[i] != acc[m]:
                v, lo, hi = acc[i], i, m
                while lo < hi:  # last index still equal to v
                    mid = (lo + hi + 1) // 2
                    if acc[mid] == v:
                        lo = mid
                    else:
                        hi = mid - 1
                if v != -1:
                    for slot in _bits(v & ~acc[lo + 1]):
                        result[id_of[slot]] = base + lo
                i = lo + 1
            alive = acc[m]
            if not alive:
                return result
        if alive != -1:
            for slot in _bits(alive):
                result[id_of[slot]] = n
        return result


class PendingPrefixes:
    """Blocks that prefills already dispatched to an instance will have stored there when they
    end: what a request queued behind them on that instance will find cached.

    Without it the scheduler prices a burst of requests sharing a new prefix as if each had to
    compute it, because the first one's blocks are stored only when its prefill ends; the
    queue estimates then overstate the work (by tens of seconds on a cold cache) and a policy
    spreads the burst over every instance, computing the prefix once on each. A FIFO prefill
    queue makes the reuse real; it is not a fetch source until stored. Counted per
    (instance, block) because several queued prompts may share blocks.
    """

    def __init__(self) -> None:
        self._index = PrefixIndex()
        self._count: dict[tuple[str, Hashable], int] = {}

    def __len__(self) -> int:
        return len(self._count)

    def add(self, instance_id: str, block_hashes: Iterable[Hashable]) -> None:
        count, new = self._count, []
        for h in block_hashes:
            key = (instance_id, h)
            n = count.get(key, 0)
            count[key] = n + 1
            if not n:
                new.append(h)
        if new:
            self._index.apply_stored(instance_id, new)

    def discard(self, instance_id: str, block_hashes: Iterable[Hashable]) -> None:
        """Undo one add() of these blocks (its prefill ended or failed); unknown ones are ignored."""
        count, gone = self._count, []
        for h in block_hashes:
            key = (instance_id, h)
            n = count.get(key)
            if n is None:
                continue
            if n == 1:
                del count[key]
                gone.append(h)
            else:
                count[key] = n - 1
        if gone:
            self._index.apply_removed(instance_id, gone)

    def match(self, block_hashes: Sequence[Hashable]) -> dict[str, int]:
        """Longest pending prefix, in blocks, per instance (as PrefixIndex.match)."""
        return self._index.match(block_hashes) if self._count else {}
