"""The embedded registry: membership held in the conductor's own process (one machine).

Entries expire `ttl_s` after their last heartbeat, measured with an injected clock. There
is no sweeper task: every entry point expires first, and each watcher expires on its idle
timeout, so deletes reach watchers within `sweep_interval_s` of the deadline.

Worker processes reach it through `registry_router` / `HttpRegistryClient` (http.py);
code in the same process (tests, a single-process dev setup) uses it directly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mooncake.registry.base import InstanceInfo, Registry, RegistryEvent, Snapshot
from mooncake.registry.config import MAX_TTL_S, RegistryConfig

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    info: InstanceInfo
    ttl_s: float
    deadline: float


@dataclass
class _LocalRegistration:
    info: InstanceInfo
    ttl_s: float
    task: asyncio.Task | None = None


class _Subscriber:
    """One watcher's inbox. Bounded: a watcher that falls behind gets a resync instead of
    an ever-growing backlog."""

    def __init__(self, limit: int) -> None:
        self.items: collections.deque[RegistryEvent] = collections.deque()
        self.overflowed = False
        self.ready = asyncio.Event()
        self._limit = limit

    def push(self, ev: RegistryEvent) -> None:
        if len(self.items) >= self._limit:
            self.items.clear()
            self.overflowed = True
        else:
            self.items.append(ev)
        self.ready.set()


class MemoryRegistry(Registry):
    """In-process registry. The sync methods (put, heartbeat, remove, list, expire) are the server side used by the HTTP router; the async Registry methods add
    in-process keepalive tasks on top."""

    def __init__(self, config: RegistryConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sweep_interval_s: float = 0.2, queue_limit: int = 4096) -> None:
        if sweep_interval_s <= 0 or queue_limit <= 0:
            raise ValueError("sweep_interval_s and queue_limit must be > 0")
        self._config = config or RegistryConfig()
        self._clock = clock
        self._sweep_s = sweep_interval_s
        self._queue_limit = queue_limit
        self._entries: dict[str, _Entry] = {}
        self._subs: set[_Subscriber] = set()
        self._local: dict[str, _LocalRegistration] = {}  # registered via the async API

    # -- server side (sync, no awaits: atomic on the event loop) --------------------------
    def put(self, info: InstanceInfo, ttl_s: float) -> None:
        """Add or replace an instance with a fresh TTL."""
        if not 0 < ttl_s <= MAX_TTL_S:  # also refuses nan
            raise ValueError(f"ttl_s={ttl_s} must be > 0 and at most {MAX_TTL_S:g} s")
        self.expire()
        self._entries[info.instance_id] = _Entry(info, ttl_s, self._clock() + ttl_s)
        self._emit(RegistryEvent("put", info.instance_id, info=info))

    def heartbeat(self, instance_id: str) -> bool:
        """Extend the TTL. False if the instance is unknown or already expired: the caller
        must register again (that is how a worker notices a restarted conductor)."""
        self.expire()
        e = self._entries.get(instance_id)
        if e is None:
            return False
        e.deadline = self._clock() + e.ttl_s
        self._emit(RegistryEvent("alive", instance_id))  # the refresh ClusterView expects
        return True

    def holder(self, instance_id: str) -> InstanceInfo | None:
        """The info the live entry of `instance_id` was put with (None: no such entry). A
        keepalive compares it with its own before it heartbeats (`claimed_by_another`)."""
        self.expire()
        e = self._entries.get(instance_id)
        return e.info if e is not None else None

    def claimed_by_another(self, info: InstanceInfo) -> bool:
        """Another registration holds `info`'s instance id now (a second process given the same
        --instance-id). Its keepalive must not refresh that entry: when the other process died,
        this one's heartbeats kept the dead one's record (its URL) listed, and this live one was
        never routed again. Left alone, the entry expires and this one's next heartbeat (404)
        puts its own info back."""
        held = self.holder(info.instance_id)
        return held is not None and held != info

    def remove(self, instance_id: str) -> bool:
        """Remove an instance now. False if it was not there."""
        if self._entries.pop(instance_id, None) is None:
            return False
        self._emit(RegistryEvent("delete", instance_id))
        return True

    def list(self) -> Snapshot:
        """Live instances."""
        self.expire()
        return {iid: e.info for iid, e in sorted(self._entries.items())}

    def expire(self) -> list[str]:
        """Remove entries past their deadline and tell watchers; returns the removed ids."""
        now = self._clock()
        dead = [iid for iid, e in self._entries.items() if e.deadline < now]
        for iid in dead:
            del self._entries[iid]
            self._emit(RegistryEvent("delete", iid))
        return dead

    def _emit(self, ev: RegistryEvent) -> None:
        for sub in self._subs:
            sub.push(ev)

    # -- Registry ABC -------------------------------------------------------------------
    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        old = self._local.pop(info.instance_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        reg = _LocalRegistration(info, ttl_s)
        self.put(info, ttl_s)
        reg.task = asyncio.get_running_loop().create_task(
            self._keepalive(reg), name=f"registry-keepalive-{info.instance_id}")
        self._local[info.instance_id] = reg

    async def _keepalive(self, reg: _LocalRegistration) -> None:
        claimed = False  # said once per claim, not every interval
        while True:
            await asyncio.sleep(self._config.keepalive_interval_s)
            if self.claimed_by_another(reg.info):
                if not claimed:
                    log.error("registry: another process registered instance id %s over this one: this one is "
                              "not routed while that one lives; give every worker its own --instance-id",
                              reg.info.instance_id)
                claimed = True
                continue
            claimed = False
            if not self.heartbeat(reg.info.instance_id):
                log.warning("registry: %s had expired; registering again", reg.info.instance_id)
                self.put(reg.info, reg.ttl_s)

    async def deregister(self, instance_id: str) -> None:
        reg = self._local.pop(instance_id, None)
        if reg is not None and reg.task is not None:
            reg.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reg.task
        self.remove(instance_id)

    async def snapshot(self) -> Snapshot:
        return self.list()

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        sub = _Subscriber(self._queue_limit)
        self._subs.add(sub)
        try:
            yield RegistryEvent("resync", snapshot=self.list())
            while True:
                while not sub.items and not sub.overflowed:
                    sub.ready.clear()
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a
                    # cancel that lands as the event fires, and the watcher never stops.
                    try:
                        async with asyncio.timeout(self._sweep_s):
                            await sub.ready.wait()
                    except TimeoutError:
                        self.expire()
                if sub.overflowed:
                    # The snapshot is current, so whatever queued since is already in it.
                    sub.overflowed = False
                    sub.items.clear()
                    yield RegistryEvent("resync", snapshot=self.list())
                else:
                    yield sub.items.popleft()
        finally:
            self._subs.discard(sub)

    async def close(self) -> None:
        tasks = [r.task for r in self._local.values() if r.task is not None]
        self._local = {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
