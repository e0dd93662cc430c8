"""Eviction policies of the pool's tiers: which evictable block goes first.

A policy only orders keys; the pool decides what is evictable (committed, not pinned, not
being loaded) and asks `victims()` for candidates in order, skipping the ones it cannot take.
Every method is O(1) except `victims`, which yields lazily (the first evictable candidate is
usually the first one); the caller must stop iterating before it changes the tier. Not
thread-safe: the pool calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: int, now: float) -> None:
        """A block entered the tier."""

    def touch(self, key: int, now: float) -> None:
        """A block of the tier was used (read, or hit by a lookup that led to a read)."""

    def remove(self, key: int) -> None:
        """A block left the tier (evicted, dropped, corrupt). Unknown keys are ignored."""

    def victims(self) -> Iterator[int]:
        """Keys in the order they should be evicted (the pool skips the ones it cannot take)."""


class LRUPolicy:
    """Least recently used first. An OrderedDict keeps the order: insert and touch move a key
    to the end, victims walk from the front."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, key: int, now: float) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: int, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[int]:
        # A live iterator: the pool stops at its first victim before it changes the tier.
        return iter(self._order)


class FIFOPolicy(LRUPolicy):
    """First stored, first evicted: a use does not renew a block (a scan-resistant baseline)."""

    def touch(self, key: int, now: float) -> None:
        pass


POLICIES: dict[str, type] = {"lru": LRUPolicy, "fifo": FIFOPolicy}
"""Policy names accepted by PoolConfig.policy."""


def make_policy(name: str) -> EvictionPolicy:
    return POLICIES[name]()
