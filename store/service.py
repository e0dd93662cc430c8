"""PoolService: one node's KVCache pool, in the worker shell process.

It owns the index (store/pool.py), the DRAM arena (store/arena.py), the SSD tier
(store/ssd.py) and the event log (store/events.py), and answers:
- the local connectors over the local channel (store/channel.py: lookup, reserve, commit,
  read/release, fetch_remote, stats, events);
- other nodes through the messenger (store/remote.py): the arena is a registered region, a
  remote get is one call that looks up and pins plus one one-sided read of the slots.

The arena is created when the first connector attaches (`configure`): only the engine knows
the KV layout, hence the bytes of a block. Until then lookups answer nothing held.

Faults never crash the pool: an SSD directory that is not writable turns the pool DRAM-only with
one warning and a counter (`ssd_errors_unwritable`); a disk that fills up shrinks the SSD tier to
the blocks on it (`ssd_errors_full`), and turns it off only when none is left; a block that fails
its checksum on the way back from disk is a miss (counted as `corrupt`), and the caller recomputes.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, Listener
from typing import Any

from mooncake.control import ControlEndpoint, accept_forever, close_listener, handshake, listen
from store import channel, channel_ops
from store.arena import Arena, ArenaInfo
from store.config import PoolConfig
from store.events import TierEventLog, TierEventsPage
from store.pool import BlockPool, Plan, checksum
from store.ssd import SpillWriter, SsdTier

log = logging.getLogger(__name__)

# Errors that mean the SSD tier cannot be used at all (rather than one bad write).
_FATAL_SSD_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
SPILL_QUEUE_BYTES = 256 << 20  # spills waiting for the disk; more are dropped (lost cache, not data)


class PoolService:
    def __init__(self, config: PoolConfig, endpoint: ControlEndpoint | None = None,
                 clock: Callable[[], float] = time.monotonic, remote: bool = True, engine_config=None):
        """`endpoint`: where the local channel listens (a fresh one if None). `remote`: serve
        and fetch blocks through the messenger once configured. `engine_config`: the
        messenger's EngineConfig (None: its defaults, with per-slice checksums off, since
        every block carries its own)."""
        self.config = config
        self.endpoint = endpoint or ControlEndpoint.new()
        self._clock = clock
        self._lock = threading.RLock()  # configure (which may degrade) and degrade; the pool has its own
        self.pool: BlockPool | None = None
        self.arena: Arena | None = None
        self.ssd: SsdTier | None = None
        self._taken_ssd: SsdTier | None = None  # the tier whose directory this pool holds, even once turned off
        self._writer: SpillWriter | None = None
        self.events = TierEventLog()
        self._events_lock = threading.Lock()
        # Held from a pool call that returns I/O until that I/O is queued (reentrant: a dropped
        # spill reports back to the pool inside _execute).
        self._io_lock = threading.RLock()
        self._counters: Counter[str] = Counter()  # the service's own; count() from any thread
        self._counters_lock = threading.Lock()
        self.layout: str | None = None
        self._listener: Listener | None = None
        self._closed = threading.Event()
        self._want_remote = remote
        self._spilling: dict[int, tuple[int, bytes]] = {}  # key -> (Spill.seq, bytes) of its last spill not on disk
        # Per key, the numbers of its spills queued to the writer, oldest first: the writer ends
        # them in that order, so each end is matched to its own spill.
        self._spills_queued: dict[int, collections.deque[int]] = {}
        self._engine_config = engine_config
        self.remote = None  # store.remote.RemotePool once configured

    # --- life ----------------------------------------------------------------------------
    def start(self) -> "PoolService":
        """Listen on the local channel (a daemon thread per connection)."""
        if os.path.exists(self.endpoint.path):
            os.unlink(self.endpoint.path)
        self._listener = listen(self.endpoint)
        threading.Thread(target=accept_forever, args=(self._listener, self._closed, self._serve, "pool-conn"),
                         name="pool-channel", daemon=True).start()
        if self.config.block_bytes:
            self.configure(self.config.block_bytes, self.layout or "")
        return self

    def configure(self, block_bytes: int, layout: str) -> ArenaInfo:
        """Create the arena, the index and the SSD tier for blocks of `block_bytes` of KV in
        `layout` (the engine's description of its KV: model, dtype, block size, shapes). Later
        calls must agree (two engines of one node share its pool only if their KV is alike)."""
        with self._lock:
            if self.arena is not None:
                if (block_bytes, layout) != (self.arena.block_bytes, self.layout):
                    raise ValueError(f"the pool holds blocks of {self.arena.block_bytes} B in layout "
                                     f"{self.layout!r}; asked for {block_bytes} B in {layout!r}")
                return self.arena.info
            config = replace(self.config, block_bytes=block_bytes)
            if config.dram_slots < 1:
                raise ValueError(f"the pool's DRAM tier ({config.dram_bytes} B) cannot hold a block of {block_bytes} B")
            arena = Arena.create(config.dram_slots, block_bytes)
            if arena.slots < config.dram_slots:  # the shared memory had room for fewer (store/arena.py)
                config = replace(config, dram_bytes=arena.slots * block_bytes)
            before = self.config
            self.config, self.layout, self.arena = config, layout, arena
            try:
                self.pool = BlockPool(config)
                self._open_ssd()
                if self._want_remote:
                    from store.remote import RemotePool

                    self.remote = RemotePool(self, self._engine_config)
            except BaseException:
                # All or nothing: half configured, a later configure would answer the arena as if
                # the pool were whole (no remote side, and fetches blamed on "not configured").
                if self._writer is not None:
                    self._writer.close()
                if self._taken_ssd is not None:
                    self._taken_ssd.close()
                self.pool = self.ssd = self._taken_ssd = self._writer = self.remote = self.layout = None
                self.arena, self.config = None, before
                self.events.forget_all()  # the SSD scan's "stored" events name blocks nobody serves now
                arena.close()
                raise
            log.info("KV pool: %d DRAM slots of %d B (%s)%s", config.dram_slots, block_bytes, arena.info.path,
                     f", SSD {config.ssd_bytes} B in {self.ssd.root}" if self.ssd else ", no SSD tier")
            return arena.info

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            close_listener(self._listener)
        if self.remote is not None:
            self.remote.close()
        if self._writer is not None:
            self._writer.close()
        if self._taken_ssd is not None:
            self._taken_ssd.close()
        if self.arena is not None:
            self.arena.close()
        shutil.rmtree(os.path.dirname(self.endpoint.path), ignore_errors=True)

    # --- operations (the channel's ops call these; the shell may too) ---------------------
    def lookup(self, keys: Sequence[int]) -> list[str]:
        if self.pool is None:
            return []
        return [tier.value for tier in self.pool.lookup(keys)]

    def reserve(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        if self.pool is None:
            return []
        if self.remote is not None:  # saves come every step: a dead peer's pins do not outlive their lease
            self.remote.expire_leases()
        with self._io_lock:
            reservation = self.pool.reserve(keys, self._clock())
            self._execute(reservation.plan)  # spills leave the slots before anyone may write them
        return reservation.slots

    def commit(self, keys: Sequence[int], checksums: Sequence[int] | None = None) -> int:
        """Commit filled slots with the checksums of the bytes their writer copied (a slot written
        into by something else meanwhile then fails its reads). Without checksums the service
        hashes the slots as they stand."""
        if self.pool is None:
            return 0
        if checksums is None:
            slots = dict(self.pool.reserved_slots(keys))
            keys = [k for k in keys if k in slots]
            checksums = [checksum(self.arena.slot(slots[k])) for k in keys]
        committed = self.pool.commit(keys, checksums, self._clock())
        self._flush_events()
        return len(committed)

    def abort(self, keys: Sequence[int]) -> None:
        if self.pool is not None:
            self.pool.abort(keys)

    def read(self, keys: Sequence[int]) -> list[tuple[int, int, int]]:
        """(key, slot, checksum) of the leading keys held, each pinned (release() unpins).
        Blocks only on SSD are loaded into DRAM and verified first; one that fails is a miss
        and ends the run."""
        if self.pool is None:
            return []
        out = []
        try:
            for key in keys:
                with self._io_lock:
                    plan = self.pool.read(key, self._clock())
                    if plan is None:
                        break
                    out.append((key, plan.slot, plan.checksum))  # pinned: released below if this fails
                    self._execute(plan.plan)
                if plan.load_from_ssd and not self._promote(key, plan.slot, plan.checksum):
                    out.pop()  # a failed promotion holds no pin (loaded() dropped the slot)
                    break
        except BaseException:
            self.release([k for k, _, _ in out])
            raise
        self._flush_events()
        return out

    def release(self, keys: Sequence[int]) -> None:
        if self.pool is not None:
            self.pool.unpin(keys)

    def remove(self, keys: Sequence[int]) -> None:
        """Forget blocks in every tier (their files go too)."""
        if self.pool is not None:
            with self._io_lock:
                self._execute(self.pool.remove(keys))
            self._flush_events()

    def discard(self, keys: Sequence[int]) -> None:
        """A reader found these blocks failing their checksum in DRAM: forget them. One another
        reader still pins stays (remove() never takes a pinned slot); every reader verifies what
        it reads, so it is a miss for them too, and goes at their discard."""
        self.count("corrupt_dram", len(keys))
        log.warning("KV pool: %d block(s) failed their checksum in DRAM; forgotten, recomputed", len(keys))
        self.remove(keys)

    def fetch_remote(self, peer, keys: Sequence[int]) -> int:
        """Bring `keys` from another node's pool (its messenger PeerInfo) into this one; the
        leading keys this node holds after. Raises messenger TransferError if the peer fails."""
        if self.remote is None:
            raise RuntimeError("this pool does not reach other nodes (not configured, or remote=False)")
        return self.remote.fetch(peer, keys)

    def peer_info(self):
        """This pool's messenger PeerInfo (publish it with the node's registration); None until
        configured."""
        return self.remote.info() if self.remote is not None else None

    def count(self, name: str, n: int = 1) -> None:
        """Add to one of the service's counters (its threads and the remote handlers all count)."""
        with self._counters_lock:
            self._counters[name] += n

    def stats(self) -> dict[str, Any]:
        usage = self.pool.usage() if self.pool is not None else {}
        with self._counters_lock:
            counters = dict(self._counters)
        if self.pool is not None:
            counters.update(self.pool.counters)
        return {"usage": usage, "counters": counters, "block_bytes": self.config.block_bytes,
                "ssd_enabled": self.ssd is not None}

    def events_since(self, seq: int) -> TierEventsPage:
        self._flush_events()
        return self.events.since(seq)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every spill queued so far is on disk (tests, shutdown)."""
        if self._writer is not None:
            self._writer.flush(timeout_s)
        self._flush_events()

    # --- the SSD tier ---------------------------------------------------------------------
    def _open_ssd(self) -> None:
        if not self.config.ssd_dir:
            return
        if not self.config.ssd_slots:
            if self.config.ssd_bytes > 0:
                log.warning("KV pool: the SSD tier in %s is off: its %d B cannot hold one block of %d B (raise "
                            "--pool-ssd-gib)", self.config.ssd_dir, self.config.ssd_bytes, self.config.block_bytes)
            return
        tier = SsdTier(self.config.ssd_dir, self.layout or "", self.config.block_bytes)
        try:
            tier.open()
            self._taken_ssd = tier  # its directory is ours now, until close
            found = tier.scan()
        except OSError as exc:
            self._count_fault(exc)
            self._turn_ssd_off(f"cannot use {self.config.ssd_dir}: {exc}")
            return
        finally:
            # The service's own counters, not the tier's: they stay reported (with their values)
            # once the tier is off, as a counter a scrape saw must.
            for kind, n in tier.skipped.items():
                self.count(f"ssd_skipped_{kind}", n)
        now = self._clock()
        restored = 0
        # Each of the ssd_shared_by pools starting on this disk sees the same free space: each
        # takes its share. A disk that fills later (a pool restarted beside full ones, another
        # program) still shrinks the tiers.
        sharers = self.config.ssd_shared_by
        room = tier.room_for_files(sharers)
        slots = self.config.ssd_slots if room is None else min(self.config.ssd_slots, len(found) + room)
        shared = f" (its share: 1/{sharers} of the free space)" if sharers > 1 else ""
        if slots == 0:
            self._turn_ssd_off(f"{tier.root} has no room for a block of {self.config.block_bytes} B{shared}")
            return
        self.ssd = tier
        if slots < self.config.ssd_slots:
            log.warning("KV pool: %s has room for %d blocks (%.2f GB)%s with the %d found there, not the %d of "
                        "--pool-ssd-gib: the SSD tier holds %d", tier.root, slots,
                        slots * self.config.block_bytes / 1e9, shared, len(found), self.config.ssd_slots, slots)
            self.pool.limit_ssd(slots)
        # The newest files when the limit shrank, restored oldest first (the policy's order).
        keep = found[-slots:] if slots else []
        for block in found[:len(found) - len(keep)]:
            self._delete_found(tier, block.key)  # beyond ssd_bytes, or the disk, now
        for block in keep:
            if self.pool.restore_ssd(block.key, block.checksum, now):
                restored += 1
            else:
                self._delete_found(tier, block.key)
        try:
            others = tier.other_layouts()
        except OSError:
            others = {}
        if others:
            files, size = sum(f for f, _ in others.values()), sum(b for _, b in others.values())
            log.warning("KV pool: %s also holds %d block files (%.2f GB) of other KV layouts (another model, "
                        "dtype or block size): this engine never reads them; delete %s to free the disk",
                        self.config.ssd_dir, files, size / 1e9, ", ".join(sorted(others)))
        self._writer = SpillWriter(tier, self._spill_done, SPILL_QUEUE_BYTES)
        self._flush_events()
        if found:
            log.info("KV pool: %d blocks restored from %s", restored, tier.root)

    def _delete_found(self, tier: SsdTier, key: int) -> None:
        """A file the start-up scan will not restore; one that cannot be deleted is left, said."""
        try:
            tier.delete(key)
        except OSError as exc:
            self.count("ssd_errors_io")
            log.warning("KV pool: cannot delete %s (%s); left in place", tier.path(key), exc)

    def _execute(self, plan: Plan) -> None:
        """Carry out a plan: copy spills out of their slots and queue the file operations. The
        caller holds _io_lock from the pool call that made the plan until this returns, so file
        operations are queued in the order the index decided them."""
        for key in plan.ssd_deletes:  # first: they name files from before this plan, which a spill
            if self.ssd is not None and self._writer is not None:  # in it may write again (same key)
                self._writer.delete(key)  # in order with the writes (store/ssd.py, SpillWriter)
        for spill in plan.spills:
            if self._writer is None:
                self.pool.ssd_written(spill.key, False, spill.seq)
                continue
            data = self.arena.slot(spill.slot).tobytes()  # before the slot is handed out again
            if not self._writer.submit(spill.key, data, spill.checksum):
                self.count("spills_dropped")
                self._execute(self.pool.ssd_written(spill.key, False, spill.seq))
                continue
            self._spilling[spill.key] = (spill.seq, data)  # readable until it is on disk
            self._spills_queued.setdefault(spill.key, collections.deque()).append(spill.seq)

    def _spill_done(self, key: int, error: OSError | None) -> None:
        with self._io_lock:
            queued = self._spills_queued[key]
            seq = queued.popleft()
            if not queued:
                del self._spills_queued[key]
            self._execute(self.pool.ssd_written(key, error is None, seq))
            if self._spilling.get(key, (None,))[0] == seq:  # a later spill keeps its copy
                del self._spilling[key]
        if error is not None:
            if error.errno in _FATAL_SSD_ERRNOS:
                self._degrade(error, "writing a block failed")
            else:
                self.count("ssd_errors_io")
                log.warning("KV pool: writing block %x to SSD failed: %s", key, error)
        self._flush_events()

    def _promote(self, key: int, slot: int, digest: int) -> bool:
        pending = self._spilling.get(key, (None, None))[1]
        ssd = self.ssd  # read once: the spill writer's thread may turn the tier off meanwhile
        ok = False
        try:
            if pending is not None:  # spilled moments ago, not on disk yet
                self.arena.slot(slot)[:] = memoryview(pending)
                ok = checksum(self.arena.slot(slot)) == digest
            else:
                ok = ssd is not None and ssd.read_into(key, self.arena.slot(slot), digest)
        except OSError as exc:
            log.warning("KV pool: reading block %x from SSD failed: %s", key, exc)
            self.count("ssd_errors_io")
        finally:  # whatever happened, the slot leaves LOADING
            if not ok and ssd is not None:
                log.warning("KV pool: block %x on SSD is missing or fails its checksum; recomputed", key)
            with self._io_lock:
                self._execute(self.pool.loaded(key, ok, self._clock()))
        return ok

    def _degrade(self, exc: OSError, what: str) -> None:
        """A write to the serving tier failed for good: DRAM only from now on, said once, counted
        each time. A full disk first shrinks the tier to the blocks on it (each later spill then
        replaces a file), and turns it off only when none is left."""
        reason = self._count_fault(exc)
        ssd = self.ssd  # read once: a configure rolled back meanwhile may have dropped it
        if reason == "full" and self.pool is not None and ssd is not None:
            before, after = self.pool.shrink_ssd()
            if after > 0:
                if after < before:
                    log.warning("KV pool: the disk under %s is full (%s: %s); the SSD tier shrinks from %d to "
                                "%d blocks", ssd.root, what, exc, before, after)
                return
        with self._lock:
            # Whether the tier serves is `self.ssd` and nothing else (a flag of its own outlived a
            # configure rolled back, and a later tier's faults were then never acted on).
            if self.ssd is None:
                return  # off already, and said
            self.ssd = None
        self._turn_ssd_off(f"{what}: {exc}")

    def _count_fault(self, exc: OSError) -> str:
        reason = "full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "unwritable"
        self.count(f"ssd_errors_{reason}")
        return reason

    def _turn_ssd_off(self, why: str) -> None:
        """DRAM only from now on (self.ssd is None already). The files stay: a later start may
        use them."""
        log.warning("KV pool: SSD tier off, DRAM only from now on (%s)", why)
        if self.pool is not None:
            self.pool.disable_ssd()

    def _flush_events(self) -> None:
        if self.pool is not None:
            with self._events_lock:  # drained and appended as one step, or two threads could swap batches
                events = self.pool.drain_events()
                if events:
                    self.events.append(events)

    # --- the local channel ----------------------------------------------------------------
    def _serve(self, conn: Connection) -> None:
        pins: Counter[int] = Counter()  # what this connection holds pinned
        if not handshake(conn, self.endpoint):
            conn.close()
            return
        try:
            while not self._closed.is_set():
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    return
                request: dict[str, Any] = {}
                try:
                    request = channel.decode(data)
                    reply = {"ok": True, **self._answer(request, pins)}
                except Exception as exc:  # noqa: BLE001 - the caller must get an answer, never a hang
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                if request.get("noreply"):
                    if not reply["ok"]:
                        log.warning("KV pool: %s from a connector failed: %s", request.get("op"), reply["error"])
                    continue
                try:
                    conn.send_bytes(channel.encode(reply))
                except OSError:
                    if request.get("op") == "reserve" and reply["ok"]:  # nobody will fill them
                        self.abort(channel.unpack_keys(reply["keys"]))
                    return
        finally:
            conn.close()
            if pins and self.pool is not None:  # a connector that died holds nothing
                self.pool.unpin(list(pins.elements()))

    def _answer(self, request: dict[str, Any], pins: Counter[int]) -> dict[str, Any]:
        return channel_ops.answer(self, request, pins)  # store/channel_ops.py: each op as a call here
