"""The pool's stored/removed events per tier, as a numbered log its readers pull.

The same contract as the engine's KV event log (mooncake/engine/kv_events.py): a reader passes
the `seq` it last saw and gets what changed since, or a full snapshot (`reset`) when it is new,
fell behind the bounded log, or the log restarted. A key may be held by both tiers at once
(the SSD tier keeps a copy of a block promoted back to DRAM).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

TIERS = ("dram", "ssd")


@dataclass(frozen=True)
class TierEventsPage:
    seq: int  # pass this as `since` next time
    events: list[tuple[str, int, str]]  # (kind "stored" | "removed", key, tier), in order: apply in order
    reset: bool  # True: forget everything known about this pool first (events are then all "stored")


class TierEventLog:
    """Thread-safe: the pool service appends, HTTP handlers read."""

    def __init__(self, max_events: int = 100_000):
        self._lock = threading.Lock()
        self._held: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self._events: deque[tuple[int, str, int, str]] = deque(maxlen=max_events)
        self._seq = 0

    def append(self, events: list[tuple[str, int, str]]) -> None:
        """BlockPool.drain_events() output: (kind, key, tier)."""
        with self._lock:
            for kind, key, tier in events:
                if kind == "stored":
                    self._held[tier].add(key)
                else:
                    self._held[tier].discard(key)
                self._seq += 1
                self._events.append((self._seq, kind, key, tier))

    def forget_all(self) -> None:
        """Every block held is gone (a pool whose start failed after restoring its SSD tier)."""
        with self._lock:
            gone = [("removed", key, tier) for tier in TIERS for key in sorted(self._held[tier])]
        self.append(gone)

    def since(self, seq: int) -> TierEventsPage:
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if seq < 0 or seq > self._seq or seq + 1 < oldest:
                snapshot = [("stored", key, tier) for tier in TIERS for key in sorted(self._held[tier])]
                return TierEventsPage(self._seq, snapshot, reset=True)
            # A block can be stored, removed and stored again between two pulls: the order matters.
            events = [(kind, key, tier) for s, kind, key, tier in self._events if s > seq]
            return TierEventsPage(self._seq, events, reset=False)

    def held(self, tier: str) -> int:
        with self._lock:
            return len(self._held[tier])
