"""Keeping the conductor's worker pool and prefix index current (the async shell).

Three loops, started by the app's lifespan:
- registry: follows the registry's watch (etcd or the embedded one) into a ClusterView and
  mirrors it into the WorkerPool: registered instances appear, expired or deleted ones leave
  (and their blocks leave the prefix index). During a registry outage the last view is kept.
- health: polls every worker's /health, so a dead process stops receiving traffic within a
  second, well inside its lease TTL.
- kv events: pulls each ready worker's stored/removed blocks into the global PrefixIndex; a
  worker that restarted, or a conductor that did, gets a full snapshot (`reset`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from conductor.core.index import PrefixIndex
from conductor.workers import WorkerClient, WorkerHandle, WorkerPool
from mooncake.registry import ClusterView, Registry

log = logging.getLogger(__name__)


def mirror_view(view: ClusterView, pool: WorkerPool, index: PrefixIndex, now: float) -> None:
    """Make the pool's registry-backed handles match the live instances of the view (pure)."""
    alive = {info.http_url.rstrip("/"): info for info in view.alive(now)}
    for url, info in alive.items():
        handle = pool.add(url)
        handle.instance_id, handle.role = info.instance_id, info.role
        handle.kv_address, handle.block_size = info.kv_address, info.block_size
        handle.kv_capacity_tokens = info.kv_capacity_tokens
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
        before = {h.http_url: h.ready for h in pool.all()}
        await asyncio.gather(*(client.check(h) for h in pool.all()))
        for h in pool.all():
            if before.get(h.http_url) and not h.ready:
                log.warning("worker %s is %s: %s", h.name, h.status, h.last_error)
                h.events_seq = -1  # when it comes back, take a full snapshot of its blocks
        await asyncio.sleep(interval_s)


async def poll_kv_events(pool: WorkerPool, index: PrefixIndex, interval_s: float,
                         headers: dict[str, str] | None = None) -> None:
    """`headers`: the cluster token's (mooncake.auth.token_headers)."""
    async with httpx.AsyncClient(timeout=2.0, headers=headers) as http:
        while True:
            await asyncio.gather(*(_pull_events(http, h, index) for h in pool.all() if h.ready))
            await asyncio.sleep(interval_s)


async def _pull_events(http: httpx.AsyncClient, handle: WorkerHandle, index: PrefixIndex) -> None:
    try:
        resp = await http.get(f"{handle.http_url}/internal/kv_events", params={"since": handle.events_seq})
        page = resp.json()
    except (httpx.HTTPError, ValueError):
        return
    if resp.status_code != 200:
        if resp.status_code == 401:  # its /health tells the health poll, which takes it out of routing
            log.debug("%s refused the cluster token on /internal/kv_events", handle.name)
        return
    if page.get("block_size"):
        handle.block_size = int(page["block_size"])
    name = handle.name
    if page["reset"]:
        index.remove_instance(name)
    if page["stored"]:
        index.apply_stored(name, [int(h, 16) for h in page["stored"]])
    if page["removed"]:
        index.apply_removed(name, [int(h, 16) for h in page["removed"]])
    handle.events_seq = int(page["seq"])
