"""Keeping the conductor's worker pool and prefix index current (the async shell).

Three loops, started by the app's lifespan:
- registry: follows the registry's watch (etcd or the embedded one) into a ClusterView and
  mirrors it into the WorkerPool: registered instances appear, expired or deleted ones leave
  (and their blocks leave the prefix index). During a registry outage the last view is kept.
- health: polls every worker's /health, so a dead process stops receiving traffic within a
  second, well inside its lease TTL.
- kv events: pulls each ready worker's stored/removed blocks into the global PrefixIndex; a
  worker that restarted, or a conductor that did, gets a full snapshot (`reset`). One long poll
  per worker (the worker holds it until it has news, up to defaults.KV_EVENTS_WAIT_S), so a
  block is in the index as soon as it is logged, and an idle cluster costs one poll per worker
  every few seconds instead of several a second.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from conductor.core.index import PrefixIndex
from conductor.workers import WorkerClient, WorkerHandle, WorkerPool
from mooncake import defaults
from mooncake.registry import ClusterView, Registry

log = logging.getLogger(__name__)


def renamed(handle: WorkerHandle, old_name: str, index: PrefixIndex) -> None:
    """The worker at this URL is another instance now (restarted with a new id): what the index
    holds under its old name goes (that process and its KV are gone), and the new one's blocks
    come from a full snapshot."""
    if handle.name != old_name and old_name != handle.http_url:  # (a handle is named by its URL until its id is known)
        log.info("worker %s is instance %s now (was %s)", handle.http_url, handle.name, old_name)
        index.remove_instance(old_name)
        handle.events_seq = -1


def mirror_view(view: ClusterView, pool: WorkerPool, index: PrefixIndex, now: float) -> None:
    """Make the pool's registry-backed handles match the live instances of the view (pure). Of
    two instances on one URL (a restart whose old lease has not run out), the newest counts."""
    alive = {info.http_url.rstrip("/"): info for info in sorted(view.alive(now), key=lambda i: i.started_at)}
    for url, info in alive.items():
        handle = pool.add(url)
        old_name = handle.name
        handle.instance_id, handle.role = info.instance_id, info.role
        renamed(handle, old_name, index)
        handle.kv_address, handle.block_size = info.kv_address, info.block_size
        handle.kv_capacity_tokens, handle.chunk_tokens = info.kv_capacity_tokens, info.chunk_tokens
    for handle in pool.all():
        if not handle.static and handle.http_url not in alive:
            log.info("instance %s left the registry; no longer routed", handle.name)
            index.remove_instance(handle.name)
            pool.remove(handle.http_url)


async def follow_registry(registry: Registry, view: ClusterView, pool: WorkerPool, index: PrefixIndex) -> None:
    async def expire_loop() -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            view.expire(now)
            mirror_view(view, pool, index, now)

    expiring = asyncio.create_task(expire_loop())
    try:
        async for event in registry.watch():
            now = time.monotonic()
            view.apply(event, now)
            if event.kind == "outage":
                log.warning("registry unreachable; serving with the last known view")
            elif event.kind == "resync":
                log.info("registry view resynced: %d instances", len(view))
            mirror_view(view, pool, index, now)
    finally:
        expiring.cancel()


async def poll_health(pool: WorkerPool, client: WorkerClient, index: PrefixIndex, interval_s: float) -> None:
    while True:
        polled = pool.polled()
        before = {h.http_url: h.ready for h in polled}
        names = {h.http_url: h.name for h in polled}
        results = await asyncio.gather(*(client.check(h) for h in polled), return_exceptions=True)
        for h, result in zip(polled, results):
            if isinstance(result, Exception):  # one worker's poll must never end the loop for all
                log.error("health poll of %s failed: %s: %s", h.name, type(result).__name__, result)
                h.ready, h.status, h.last_error = False, "unreachable", f"{type(result).__name__}: {result}"
        for h in polled:
            renamed(h, names[h.http_url], index)
            if before.get(h.http_url) and not h.ready:
                log.warning("worker %s is %s: %s", h.name, h.status, h.last_error)
                # Its blocks leave the index now, not when it is back: a restarted process keeps
                # its name (serve's decode-1) and answers /health ready before its follower's
                # first snapshot, and routes priced on the dead process's blocks in between
                # (P skipped blocks that D no longer held; D recomputed the whole prompt).
                index.remove_instance(h.name)
                h.events_seq = -1  # when it comes back, take a full snapshot of its blocks
        await asyncio.sleep(interval_s)


async def poll_kv_events(pool: WorkerPool, index: PrefixIndex, interval_s: float,
                         headers: dict[str, str] | None = None,
                         wait_s: float = defaults.KV_EVENTS_WAIT_S,
                         transport: httpx.AsyncBaseTransport | None = None) -> None:
    """Keep one long-polling task per ready worker (checked every `interval_s`). `headers`: the
    cluster token's (mooncake.auth.token_headers); `transport`: httpx's (tests reach an app in
    process with it)."""
    followers: dict[str, tuple[WorkerHandle, asyncio.Task]] = {}  # by http_url
    # Each follower holds a connection for up to wait_s: no pool limit may queue them.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=wait_s + 5.0, headers=headers, limits=limits, transport=transport) as http:
        try:
            while True:
                for handle in pool.all():
                    followed, task = followers.get(handle.http_url, (None, None))
                    if followed is not handle and task is not None:
                        task.cancel()  # removed and added again: the old handle's poll is of no use
                    if handle.ready and (followed is not handle or task.done()):
                        followers[handle.http_url] = (handle, asyncio.create_task(
                            _follow_events(http, pool, handle, index, interval_s, wait_s)))
                await asyncio.sleep(interval_s)
        finally:
            tasks = [task for _, task in followers.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _follow_events(http: httpx.AsyncClient, pool: WorkerPool, handle: WorkerHandle, index: PrefixIndex,
                         interval_s: float, wait_s: float) -> None:
    """Pull `handle`'s events while it is ready and in the pool. A poll that comes back early with
    nothing (an error, a worker that does not hold polls, or one that is draining) is followed by
    a pause, so no worker is ever polled in a tight loop."""
    loop = asyncio.get_running_loop()
    while handle.ready and pool.handles.get(handle.http_url) is handle:
        started = loop.time()
        try:
            news = await _pull_events(http, pool, handle, index, wait_s)
        except Exception:  # noqa: BLE001 - a malformed page: say so, keep following
            log.exception("could not apply the KV events of %s", handle.name)
            news = False
        if not news:
            await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))


async def _pull_events(http: httpx.AsyncClient, pool: WorkerPool, handle: WorkerHandle, index: PrefixIndex,
                       wait_s: float = 0.0) -> bool:
    """One poll of the worker's events into the index; True when it brought any (or a reset)."""
    asked = handle.events_seq
    try:
        resp = await http.get(f"{handle.http_url}/internal/kv_events", params={"since": asked, "wait": wait_s})
        page = resp.json()
    except (httpx.HTTPError, ValueError):
        return False
    if resp.status_code != 200:
        if resp.status_code == 401:  # its /health tells the health poll, which takes it out of routing
            log.debug("%s refused the cluster token on /internal/kv_events", handle.name)
        return False
    # While the poll was held the worker may have left, or gone down (the health poll then asks
    # for a snapshot: events_seq -1); a page of the process that was there then is dropped.
    if pool.handles.get(handle.http_url) is not handle or not handle.ready or handle.events_seq != asked:
        return False
    if page.get("block_size"):
        handle.block_size = int(page["block_size"])
    name = handle.name
    if page["reset"]:
        index.remove_instance(name)
    if page["stored"]:
        # Blocks only in the worker's pool carry their tier (a hit on them costs a load); an older
        # worker sends none, and its blocks are priced as in its engine.
        tiers = {int(h, 16): str(t) for h, t in (page.get("pool_tiers") or {}).items()}
        index.apply_stored(name, [int(h, 16) for h in page["stored"]], tiers)
    if page["removed"]:
        index.apply_removed(name, [int(h, 16) for h in page["removed"]])
    handle.events_seq = int(page["seq"])
    return bool(page["reset"] or page["stored"] or page["removed"])
