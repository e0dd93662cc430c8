"""BlockPool: the index of one node's KVCache pool (pure: no I/O, no clock, thread-safe).

Keys are `mooncake.hashing` chained prefix hashes; a block is `block_bytes` of KV (all layers).
Two tiers: DRAM (slots of the shared-memory arena, numbered 0..dram_slots-1) and SSD (block
files, counted in blocks). The SSD tier is inclusive: a block promoted back to DRAM keeps its
file, so evicting it from DRAM again costs no write.

The life of a block:
  reserve(keys)  -> a DRAM slot per missing key, state RESERVED: never returned by lookup or
                    read, never evicted. The writer fills the slot, then
  commit(keys, checksums) -> COMMITTED (xxh3-64 of the slot's bytes), or abort(keys) -> freed.
                    A reservation neither committed nor aborted within reserve_lease_s (its
                    writer died) is freed by the next reserve.
  read(key)      -> (slot, checksum), pinned: never evicted until unpin(key). A block only on
                    SSD gets a DRAM slot (state LOADING) and the plan says load it; the owner
                    reads the file (or, for a spill not yet on disk, its copy) into the slot,
                    verifies the checksum and calls loaded(key, ok).
  eviction       -> the least valuable unpinned COMMITTED block (the policy's order) leaves DRAM
                    to make room. Without an SSD copy it is spilled: the plan carries a Spill
                    that the owner must copy out of the slot BEFORE anyone writes the slot
                    again (the reply that hands the slot out comes after), then write to disk
                    and report with ssd_written(key, ok). A full SSD tier evicts its own victim
                    (the plan lists the file to delete).

Mutating calls return the I/O the owner must do (`Plan`); the pool itself never touches memory
or files, so it is tested in milliseconds. Events (stored/removed per tier) queue until the
owner drains them. Every public method holds one lock; each is O(keys) plus an eviction scan
that stops at the first evictable block.
"""

from __future__ import annotations

import enum
import heapq
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from store.config import PoolConfig
from store.policy import make_policy


class Tier(enum.StrEnum):
    DRAM = "dram"
    SSD = "ssd"


class State(enum.Enum):
    RESERVED = "reserved"  # a writer is filling the slot
    COMMITTED = "committed"
    LOADING = "loading"  # being promoted from SSD into the slot


def checksum(data) -> int:
    """The checksum every block carries: xxh3-64 of its bytes (any buffer)."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class Spill:
    """Copy `slot` (block `key`, its `checksum`) out before the slot is handed to anyone else,
    then write it to the SSD tier and report ssd_written(key, ok, seq)."""

    key: int
    slot: int
    checksum: int
    seq: int = 0
    """This spill's number: a key removed and spilled again while its first write is queued has
    two writes in flight, and only the last one's end may mark the entry written."""


@dataclass
class Plan:
    """The I/O a call asks of its owner: file deletions first, then spills (in order). A delete
    names a file from before the plan (a spill still in flight is never evicted), and the same
    plan may spill that key again: evicted from SSD, then from DRAM."""

    spills: list[Spill] = field(default_factory=list)
    ssd_deletes: list[int] = field(default_factory=list)

    def extend(self, other: "Plan") -> None:
        self.spills.extend(other.spills)
        self.ssd_deletes.extend(other.ssd_deletes)


@dataclass(frozen=True)
class Reservation:
    slots: list[tuple[int, int]]  # (key, slot) for each key reserved, in the order asked
    plan: Plan


@dataclass(frozen=True)
class ReadPlan:
    key: int
    slot: int
    checksum: int
    load_from_ssd: bool  # True: read the SSD file into the slot, verify, call loaded(key, ok)
    plan: Plan


@dataclass
class _DramEntry:
    slot: int
    state: State
    checksum: int = 0
    pins: int = 0


@dataclass
class _SsdEntry:
    checksum: int
    ready: bool  # the file is written (a spill in flight is not: its owner still holds a copy)
    readers: int = 0  # promotions reading the file now: not evicted meanwhile
    seq: int = 0  # the spill that writes it (Spill.seq); 0 for a file found at start-up


Event = tuple[str, int, str]  # ("stored" | "removed", key, "dram" | "ssd")


class BlockPool:
    def __init__(self, config: PoolConfig):
        if not config.block_bytes:
            raise ValueError("BlockPool needs PoolConfig.block_bytes (the KV bytes of one block)")
        self.config = config
        self._lock = threading.Lock()
        # A min-heap: the lowest free slot goes first, so blocks reserved together get adjacent
        # slots and a transfer of a run of them is one slice (store/remote.py coalesces).
        self._free_slots = list(range(config.dram_slots))
        self._dram: dict[int, _DramEntry] = {}
        self._ssd: dict[int, _SsdEntry] = {}
        self._ssd_capacity = config.ssd_slots
        self._dram_order = make_policy(config.policy)
        self._ssd_order = make_policy(config.policy)
        self._events: list[Event] = []
        self._reserved_at: dict[int, float] = {}  # key -> when reserved, oldest first
        self._spills_made = 0  # numbers the spills (Spill.seq)
        self.counters = {"spills": 0, "promotions": 0, "corrupt": 0, "dram_evictions": 0, "ssd_evictions": 0,
                         "spill_failures": 0, "reservations_expired": 0}

    # --- queries -------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int]) -> list[Tier]:
        """The tier of each leading key the pool can serve (stops at the first it cannot)."""
        tiers = []
        with self._lock:
            for key in keys:
                entry = self._dram.get(key)
                if entry is not None and entry.state is State.COMMITTED:
                    tiers.append(Tier.DRAM)
                    continue
                if key in self._ssd:  # a spill still on its way to disk is served from its copy
                    tiers.append(Tier.SSD)
                    continue
                break
        return tiers

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity_bytes, used_bytes (reserved and loading slots included), blocks
        (the ones lookup can serve)."""
        bb = self.config.block_bytes
        with self._lock:
            dram_blocks = sum(1 for e in self._dram.values() if e.state is State.COMMITTED)
            ssd_blocks = len(self._ssd)
            return {
                Tier.DRAM.value: {"capacity_bytes": self.config.dram_slots * bb, "used_bytes": len(self._dram) * bb,
                                  "blocks": dram_blocks},
                Tier.SSD.value: {"capacity_bytes": self._ssd_capacity * bb, "used_bytes": len(self._ssd) * bb,
                                 "blocks": ssd_blocks},
            }

    def reserved_slots(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """(key, slot) of each key that is reserved now (not yet committed)."""
        with self._lock:
            return [(k, e.slot) for k in keys if (e := self._dram.get(k)) is not None and e.state is State.RESERVED]

    def drain_events(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, []
        return events

    # --- writing -------------------------------------------------------------------------
    def reserve(self, keys: Sequence[int], now: float) -> Reservation:
        """A DRAM slot for each key the pool does not hold (keys held in any tier, or being
        written, are skipped). Stops at the first key no slot can be found for (everything
        else pinned or in flight)."""
        slots: list[tuple[int, int]] = []
        plan = Plan()
        with self._lock:
            self._expire_reservations(now)
            for key in keys:
                if key in self._dram or key in self._ssd:
                    continue
                slot = self._take_slot(plan)
                if slot is None:
                    break
                self._dram[key] = _DramEntry(slot, State.RESERVED)
                self._reserved_at[key] = now
                slots.append((key, slot))
        return Reservation(slots, plan)

    def commit(self, keys: Sequence[int], checksums: Sequence[int], now: float) -> list[int]:
        """RESERVED -> COMMITTED with each block's checksum. Returns the keys committed (a key
        not reserved, e.g. aborted meanwhile, is skipped)."""
        if len(keys) != len(checksums):
            raise ValueError(f"{len(keys)} keys but {len(checksums)} checksums")
        done = []
        with self._lock:
            for key, digest in zip(keys, checksums):
                entry = self._dram.get(key)
                if entry is None or entry.state is not State.RESERVED:
                    continue
                self._reserved_at.pop(key, None)
                entry.state, entry.checksum = State.COMMITTED, digest
                self._dram_order.insert(key, now)
                self._events.append(("stored", key, Tier.DRAM.value))
                done.append(key)
        return done

    def abort(self, keys: Sequence[int]) -> None:
        """Give back reserved slots that will not be committed."""
        with self._lock:
            for key in keys:
                entry = self._dram.get(key)
                if entry is not None and entry.state is State.RESERVED:
                    self._free_reserved(key)

    # --- reading -------------------------------------------------------------------------
    def read(self, key: int, now: float, pin: bool = True) -> ReadPlan | None:
        """Where to read `key` from, pinned when `pin` (the caller unpins). None: a miss (not
        held, still being written or promoted by another reader, or no DRAM slot free for a
        promotion)."""
        with self._lock:
            entry = self._dram.get(key)
            if entry is not None:
                if entry.state is not State.COMMITTED:
                    return None
                entry.pins += pin
                self._dram_order.touch(key, now)
                ssd = self._ssd.get(key)
                if ssd is not None:
                    self._ssd_order.touch(key, now)
                return ReadPlan(key, entry.slot, entry.checksum, False, Plan())
            ssd = self._ssd.get(key)
            if ssd is None:
                return None
            plan = Plan()
            ssd.readers += 1  # before a slot is found: the SSD tier must not evict this very file for it
            slot = self._take_slot(plan)
            if slot is None:
                ssd.readers -= 1
                return None
            self._ssd_order.touch(key, now)
            self._dram[key] = _DramEntry(slot, State.LOADING, ssd.checksum, pins=int(pin))
            return ReadPlan(key, slot, ssd.checksum, True, plan)

    def loaded(self, key: int, ok: bool, now: float) -> Plan:
        """A promotion ended: ok -> the block is in DRAM too; not ok (checksum or read failed)
        -> the block is gone from both tiers (its file is listed for deletion)."""
        plan = Plan()
        with self._lock:
            entry = self._dram.get(key)
            ssd = self._ssd.get(key)
            if ssd is not None:
                ssd.readers = max(0, ssd.readers - 1)
            if entry is None or entry.state is not State.LOADING:
                return plan
            if ok:
                entry.state = State.COMMITTED
                self._dram_order.insert(key, now)
                self._events.append(("stored", key, Tier.DRAM.value))
                self.counters["promotions"] += 1
                return plan
            self.counters["corrupt"] += 1
            del self._dram[key]
            heapq.heappush(self._free_slots, entry.slot)
            if ssd is not None:
                self._drop_ssd(key, plan)
        return plan

    def pin(self, keys: Sequence[int]) -> list[int]:
        """Pin committed DRAM blocks; returns the keys pinned."""
        pinned = []
        with self._lock:
            for key in keys:
                entry = self._dram.get(key)
                if entry is not None and entry.state is State.COMMITTED:
                    entry.pins += 1
                    pinned.append(key)
        return pinned

    def unpin(self, keys: Sequence[int]) -> None:
        with self._lock:
            for key in keys:
                entry = self._dram.get(key)
                if entry is not None and entry.pins > 0:
                    entry.pins -= 1

    def pins(self, key: int) -> int:
        with self._lock:
            entry = self._dram.get(key)
            return entry.pins if entry is not None else 0

    # --- the SSD tier ----------------------------------------------------------------------
    def ssd_written(self, key: int, ok: bool, seq: int | None = None) -> Plan:
        """A spill's write ended. Not ok: the block is gone from the SSD tier. seq: the spill's
        number; the end of an earlier spill of the same key (removed and spilled again since)
        changes nothing: the entry waits for its own write."""
        plan = Plan()
        with self._lock:
            ssd = self._ssd.get(key)
            if ssd is None or ssd.ready or (seq is not None and seq != ssd.seq):
                return plan
            if ok:
                ssd.ready = True
                self._events.append(("stored", key, Tier.SSD.value))
            else:
                self.counters["spill_failures"] += 1
                del self._ssd[key]
                self._ssd_order.remove(key)
                plan.ssd_deletes.append(key)  # a partial file may be left
        return plan

    def restore_ssd(self, key: int, digest: int, now: float) -> bool:
        """A block file found on disk at start-up (the SSD index is rebuilt by a scan). False
        when the tier is full (the caller deletes the file)."""
        with self._lock:
            if key in self._ssd:
                return True
            if len(self._ssd) >= self._ssd_capacity:
                return False
            self._ssd[key] = _SsdEntry(digest, ready=True)
            self._ssd_order.insert(key, now)
            self._events.append(("stored", key, Tier.SSD.value))
            return True

    def limit_ssd(self, slots: int) -> None:
        """At start-up, before any restore: the disk has room for only this many blocks."""
        with self._lock:
            self._ssd_capacity = min(self._ssd_capacity, max(slots, 0))

    def shrink_ssd(self) -> tuple[int, int]:
        """The disk is full: hold no more SSD blocks than the tier has now (on disk, or on their
        way: the failed write's entry is gone already), so each later spill evicts a file first.
        Returns (the capacity before, after); 0 after: turn the tier off."""
        with self._lock:
            before = self._ssd_capacity
            self._ssd_capacity = min(before, len(self._ssd))
            return before, self._ssd_capacity

    def disable_ssd(self) -> Plan:
        """The SSD tier is unusable (unwritable directory, full disk): DRAM only from now on.
        Every SSD entry goes at once; a promotion in flight then fails its read or checksum
        and is a miss, never wrong bytes."""
        plan = Plan()
        with self._lock:
            self._ssd_capacity = 0
            for key in list(self._ssd):
                self._drop_ssd(key, plan)
        return plan

    def remove(self, keys: Sequence[int]) -> Plan:
        """Forget blocks in every tier (e.g. found corrupt by a reader). Pinned DRAM blocks stay
        until unpinned: their readers hold the slot."""
        plan = Plan()
        with self._lock:
            for key in keys:
                entry = self._dram.get(key)
                if entry is not None and entry.state is State.COMMITTED and entry.pins == 0:
                    self._drop_dram(key)
                if key in self._ssd and self._ssd[key].readers == 0:
                    self._drop_ssd(key, plan)
        return plan

    # --- internals (under the lock) ----------------------------------------------------------
    def _expire_reservations(self, now: float) -> None:
        horizon = now - self.config.reserve_lease_s
        while self._reserved_at:
            key, since = next(iter(self._reserved_at.items()))
            if since > horizon:
                return
            self._free_reserved(key)
            self.counters["reservations_expired"] += 1

    def _free_reserved(self, key: int) -> None:
        entry = self._dram.pop(key)
        self._reserved_at.pop(key, None)
        heapq.heappush(self._free_slots, entry.slot)

    def _take_slot(self, plan: Plan) -> int | None:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        victim = next((k for k in self._dram_order.victims() if self._evictable(k)), None)
        if victim is None:
            return None
        entry = self._dram[victim]
        if victim not in self._ssd and self._ssd_room(plan):
            self._spills_made += 1
            self._ssd[victim] = _SsdEntry(entry.checksum, ready=False, seq=self._spills_made)
            self._ssd_order.insert(victim, 0.0)
            plan.spills.append(Spill(victim, entry.slot, entry.checksum, self._spills_made))
            self.counters["spills"] += 1
        self.counters["dram_evictions"] += 1
        return self._drop_dram(victim, free=False)

    def _evictable(self, key: int) -> bool:
        entry = self._dram[key]
        return entry.state is State.COMMITTED and entry.pins == 0

    def _drop_dram(self, key: int, free: bool = True) -> int:
        entry = self._dram.pop(key)
        self._dram_order.remove(key)
        self._events.append(("removed", key, Tier.DRAM.value))
        if free:
            heapq.heappush(self._free_slots, entry.slot)
        return entry.slot

    def _ssd_room(self, plan: Plan) -> bool:
        if self._ssd_capacity <= 0:
            return False
        if len(self._ssd) < self._ssd_capacity:
            return True
        victim = next((k for k in self._ssd_order.victims()
                       if self._ssd[k].ready and self._ssd[k].readers == 0), None)
        if victim is None:
            return False
        self.counters["ssd_evictions"] += 1
        self._drop_ssd(victim, plan)
        return True

    def _drop_ssd(self, key: int, plan: Plan) -> None:
        entry = self._ssd.pop(key)
        self._ssd_order.remove(key)
        if entry.ready:
            self._events.append(("removed", key, Tier.SSD.value))
        plan.ssd_deletes.append(key)
