"""A worker's KV events, in the conductor's terms.

vLLM publishes BlockStored / BlockRemoved events (over ZMQ) keyed by its own block hashes. The
conductor's prefix index is keyed by `mooncake.hashing`, which it computes from the prompt's
tokens. BlockHashTranslator re-keys each stored block from the token ids inside the event,
chained through its parent, so a hit the conductor predicts is exactly a block the engine holds.
BlockEventLog keeps a numbered log the conductor pulls (`/internal/kv_events?since=N`), plus
the current set, so a conductor that restarted or fell behind gets a full snapshot instead of a
silently wrong index.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

from mooncake.hashing import BlockHash, hash_block_tokens

log = logging.getLogger(__name__)


class BlockHashTranslator:
    def __init__(self, extra_keys: tuple = ()):
        self._extra = extra_keys
        self._ours: dict[Hashable, BlockHash] = {}

    def stored(self, engine_hashes: list, parent: Hashable | None, token_ids: list[int],
               block_size: int) -> list[BlockHash]:
        if parent is not None and parent not in self._ours:
            # We never saw the parent (events lost): its chain cannot be re-keyed, so these
            # blocks stay out of the index. A missed hit costs a recompute, a wrong key would not.
            return []
        ours: BlockHash | None = self._ours.get(parent) if parent is not None else None
        out = []
        for i, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size:
                break
            ours = hash_block_tokens(ours, tokens, self._extra)
            self._ours[engine_hash] = ours
            out.append(ours)
        return out

    def removed(self, engine_hashes: list) -> list[BlockHash]:
        return [h for h in (self._ours.pop(e, None) for e in engine_hashes) if h is not None]

    def cleared(self) -> None:
        self._ours.clear()


@dataclass(frozen=True)
class EventsPage:
    seq: int  # pass this as `since` next time
    stored: list[BlockHash]  # held now (new, or its fastest tier changed)
    removed: list[BlockHash]  # held by no tier now
    reset: bool  # True: replace everything known about this worker with `stored`
    pool_tiers: dict[BlockHash, str] = field(default_factory=dict)
    """Of `stored`, those held only in the pool (the engine evicted them), by fastest tier: a hit
    on them costs a load. The others are in the engine."""


ENGINE_TIER = "engine"
"""Blocks in the engine's own KV cache (vLLM's events); the node's pool adds its tiers
("dram", "ssd": store/). A block is held while any tier holds it."""
POOL_TIERS = ("dram", "ssd")
"""The pool's tiers, fastest first, as its events name them (store/events.py)."""
_TIER_ORDER = {tier: i for i, tier in enumerate((ENGINE_TIER, *POOL_TIERS))}  # an unknown tier is slowest


def _fastest(tiers: set[str]) -> str | None:
    return min(tiers, key=lambda t: (_TIER_ORDER.get(t, len(_TIER_ORDER)), t)) if tiers else None


class BlockEventLog:
    """Thread-safe: the subscriber thread appends, HTTP handlers read. The log is of the node as
    a whole: a block is stored when its first tier gets it and removed when its last one drops it,
    so a conductor's index sees a prefix the pool holds after the engine evicted it. A change of a
    held block's fastest tier is logged too, so the conductor can price a hit by where it must be
    loaded from. A page reports each block's state at the time of the read (held, and where; or
    not), whatever happened to it in between."""

    def __init__(self, max_events: int = 100_000):
        self._lock = threading.Lock()
        self._held: dict[BlockHash, set[str]] = {}
        self._events: deque[tuple[int, BlockHash]] = deque(maxlen=max_events)
        self._seq = 0
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, changed: Callable[[], None]) -> None:
        """`changed()` runs (on the changing thread, outside the lock) after each change of seq."""
        self._listeners.append(changed)

    def _changed(self, before: int) -> None:
        if self._seq != before:
            for changed in self._listeners:
                changed()

    def _log(self, h: BlockHash) -> None:
        self._seq += 1
        self._events.append((self._seq, h))

    def stored(self, hashes: list[BlockHash], tier: str = ENGINE_TIER) -> None:
        before = self._seq
        with self._lock:
            for h in hashes:
                tiers = self._held.setdefault(h, set())
                was = _fastest(tiers)
                tiers.add(tier)
                if _fastest(tiers) != was:
                    self._log(h)
        self._changed(before)

    def removed(self, hashes: list[BlockHash], tier: str = ENGINE_TIER) -> None:
        before = self._seq
        with self._lock:
            for h in hashes:
                tiers = self._held.get(h)
                if tiers is not None:
                    was = _fastest(tiers)
                    tiers.discard(tier)
                    if tiers and _fastest(tiers) == was:
                        continue  # a slower tier dropped it: nothing a reader sees changed
                    if not tiers:
                        del self._held[h]
                self._log(h)  # an unknown block too: a reader may hold it from an older snapshot
        self._changed(before)

    def cleared(self, tier: str | None = None) -> None:
        """Forget what `tier` holds (every tier: None); readers take a snapshot next time."""
        before = self._seq
        with self._lock:
            for h in list(self._held):
                tiers = self._held[h]
                if tier is None:
                    tiers.clear()
                else:
                    tiers.discard(tier)
                if not tiers:
                    del self._held[h]
            self._events.clear()
            self._seq += 1  # anyone behind this point must take a snapshot
        self._changed(before)

    def since(self, seq: int) -> EventsPage:
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if seq < 0 or seq > self._seq or seq + 1 < oldest:
                stored = sorted(self._held)
                return EventsPage(self._seq, stored, [], True, self._pool_tiers(stored))
            touched = {h for s, h in self._events if s > seq}
            stored = sorted(h for h in touched if h in self._held)
            removed = sorted(h for h in touched if h not in self._held)
            return EventsPage(self._seq, stored, removed, False, self._pool_tiers(stored))

    def _pool_tiers(self, hashes: list[BlockHash]) -> dict[BlockHash, str]:
        out = {}
        for h in hashes:
            tiers = self._held[h]
            if ENGINE_TIER not in tiers:
                out[h] = _fastest(tiers)
        return out

    def tier_blocks(self) -> dict[str, int]:
        """Blocks per tier (a block held by two tiers counts in both)."""
        with self._lock:
            counts: dict[str, int] = {}
            for tiers in self._held.values():
                for tier in tiers:
                    counts[tier] = counts.get(tier, 0) + 1
            return counts

    def __len__(self) -> int:
        return len(self._held)


class LogChanges:
    """Wakes the coroutines that wait for a BlockEventLog to change (a conductor's long poll of
    /internal/kv_events), from whichever thread changed it.

    Take `current()` before reading the log, then await it: a change after the read sets that
    very event, so no change slips between the read and the wait."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._wake_pending = threading.Event()  # one wake-up queued on the loop at a time

    def current(self) -> asyncio.Event:
        return self._event

    def notify_threadsafe(self) -> None:
        if self._wake_pending.is_set():
            return
        self._wake_pending.set()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending.clear()
        self._event.set()
        self._event = asyncio.Event()


EVENTS_HOST = "127.0.0.1"  # the engine runs on this worker's machine; nothing else may publish here


def publisher_endpoint(port: int) -> str:
    """The endpoint handed to vLLM's KVEventsConfig: a plain (non-wildcard) tcp address, which
    vLLM's ZmqEventPublisher connects to, so this worker's subscriber must be the side that binds."""
    return f"tcp://{EVENTS_HOST}:{port}"


class KVEventsUnavailable(RuntimeError):
    """The worker cannot listen for its engine's KV events: without them no conductor would ever
    see this worker's cache, so the worker must not start as if all were well."""


class KVEventSubscriber:
    """Reads the engine's ZMQ event stream in a thread and feeds the log.

    This side binds the loopback endpoint and vLLM's publisher connects to it: vLLM binds only a
    wildcard (`tcp://*:P`, every interface) or ipc endpoint and connects to any other, so with
    both sides connecting (as before) no event ever arrived and the conductors' prefix index
    stayed empty. The socket is bound here, in the constructor, BEFORE the engine is built and
    told the port: a port picked earlier and bound later could be taken in between, and a bind
    that fails raises KVEventsUnavailable instead of leaving a worker that looks ready but is
    missing from every conductor's index. `port=0` lets the OS pick a free one (`.port` says which).

    One owner, one release: whoever constructs it calls stop(), which ends the reading thread and
    closes the socket (the thread closes it on its way out, since a ZMQ socket must not be used by
    two threads at once; stop() closes it itself when the thread never started)."""

    def __init__(self, log_: BlockEventLog, translator: BlockHashTranslator, port: int = 0):
        import zmq

        self._log = log_
        self._translator = translator
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 500)
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{EVENTS_HOST}")
            else:
                self._sock.bind(publisher_endpoint(port))
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise KVEventsUnavailable(
                f"cannot listen for the engine's KV events on {publisher_endpoint(port)}: {exc}; "
                "the conductors would not see this worker's cache") from exc
        self.port = port
        self.endpoint = publisher_endpoint(port)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.ident is None:  # never started: nobody else holds the socket
            self._sock.close(linger=0)
        else:
            self._thread.join(timeout_s)  # it polls every 0.5 s, then closes the socket

    def _run(self) -> None:
        try:
            self._receive()
        finally:
            self._sock.close(linger=0)

    def _receive(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = self._sock
        last_seq = -1
        while not self._stop.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                _topic, seq_bytes, payload = frames
                events = decoder.decode(payload).events
            except (ValueError, msgspec.DecodeError) as exc:
                # A message we cannot read: what it said is lost, so the log starts over (the
                # conductors resync) and the thread lives on; a dead reader would leave the worker
                # ready while its cache vanished from every conductor's index.
                log.warning("unreadable KV event message (%s); the conductor will resync", exc)
                self._translator.cleared()
                self._log.cleared(ENGINE_TIER)
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq >= 0 and seq != last_seq + 1:
                log.warning("missed KV events %d..%d; the conductor will resync", last_seq + 1, seq - 1)
                self._translator.cleared()
                self._log.cleared(ENGINE_TIER)
            last_seq = seq
            for event in events:
                if isinstance(event, BlockStored):
                    self._log.stored(self._translator.stored(
                        list(event.block_hashes), event.parent_block_hash, list(event.token_ids), event.block_size))
                elif isinstance(event, BlockRemoved):
                    self._log.removed(self._translator.removed(list(event.block_hashes)))
                elif isinstance(event, AllBlocksCleared):
                    self._translator.cleared()
                    self._log.cleared(ENGINE_TIER)
