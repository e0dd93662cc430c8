"""The embedded registry over HTTP, for worker processes on the conductor's machine.

The conductor mounts `registry_router(memory_registry)` on its FastAPI app; workers use
`HttpRegistryClient`. A heartbeat answered 404 means the conductor no longer knows the
instance (it restarted, or the instance expired while the worker was stalled), and the
client registers again by itself, so restarting the conductor needs no worker restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
from fastapi import APIRouter, HTTPException, Request, Response

from mooncake.auth import token_headers
from mooncake.registry.base import (InstanceInfo, Registry, RegistryEvent, RegistryRefused, RegistryUnavailable,
                                    Snapshot, decode_info, encode_info)
from mooncake.registry.config import RegistryConfig
from mooncake.registry.memory import MemoryRegistry
from mooncake.registry.retry import retrying

log = logging.getLogger(__name__)

ROUTE_PREFIX = "/internal/registry"


class Registration(msgspec.Struct, frozen=True):
    """Body of POST /instances."""

    info: InstanceInfo
    ttl_s: float


class Listing(msgspec.Struct, frozen=True):
    """Answer of GET /instances."""

    instances: list[InstanceInfo]
    v: int = 1


_REGISTRATION = msgspec.json.Decoder(Registration)
_LISTING = msgspec.json.Decoder(Listing)


def registry_router(registry: MemoryRegistry) -> APIRouter:
    """Internal routes over `registry`; mount with `app.include_router(...)`.

    POST   /internal/registry/instances                {"info", "ttl_s"}
    POST   /internal/registry/instances/{id}/heartbeat  404 if unknown: register again; body
                                                         (optional): the caller's InstanceInfo,
                                                         409 if another process holds the id
    DELETE /internal/registry/instances/{id}
    GET    /internal/registry/instances                 {"instances": [...], "v": 1}
    """
    router = APIRouter(prefix=ROUTE_PREFIX, tags=["internal-registry"])

    @router.post("/instances")
    async def register(request: Request) -> dict[str, Any]:
        try:
            body = _REGISTRATION.decode(await request.body())
            registry.put(body.info, body.ttl_s)
        except ValueError as e:  # msgspec's DecodeError is one, and names the field
            raise HTTPException(400, f"bad registration: {e}") from None
        return {"ok": True}

    @router.post("/instances/{instance_id}/heartbeat")
    async def heartbeat(instance_id: str, request: Request) -> dict[str, Any]:
        raw = await request.body()  # empty from an older worker: refreshed whoever holds the id
        if raw:
            try:
                mine = decode_info(raw)
            except ValueError as e:
                raise HTTPException(400, f"bad heartbeat: {e}") from None
            if mine.instance_id != instance_id:
                raise HTTPException(400, f"heartbeat of {instance_id!r} carries {mine.instance_id!r}'s info")
            # No await from here to the heartbeat: the check and the refresh are one step.
            if registry.claimed_by_another(mine):
                raise HTTPException(409, f"instance id {instance_id!r} is registered by another process")
        if not registry.heartbeat(instance_id):
            raise HTTPException(404, f"unknown instance {instance_id!r}: register again")
        return {"ok": True}

    @router.delete("/instances/{instance_id}")
    async def deregister(instance_id: str) -> dict[str, Any]:
        return {"removed": registry.remove(instance_id)}

    @router.get("/instances")
    async def list_instances() -> Response:
        listing = Listing(list(registry.list().values()))
        return Response(msgspec.json.encode(listing), media_type="application/json")

    return router


@dataclass
class _Registration:
    info: InstanceInfo
    ttl_s: float
    task: asyncio.Task | None = None


class HttpRegistryClient(Registry):
    """Worker-side client of the conductor-hosted registry (url embedded+http://host:port)."""

    def __init__(self, config: RegistryConfig) -> None:
        if config.scheme not in ("embedded+http", "embedded+https"):
            raise ValueError(f"HttpRegistryClient needs an embedded+http:// url, got "
                             f"{config.url!r}")
        self._config = config
        (host, port), = config.endpoints()
        scheme = config.scheme.split("+", 1)[1]
        self._http = httpx.AsyncClient(base_url=f"{scheme}://{host}:{port}{ROUTE_PREFIX}",
                                       timeout=config.request_timeout_s,
                                       headers=token_headers(config.cluster_token))
        self._regs: dict[str, _Registration] = {}

    async def _call(self, method: str, path: str, passed: tuple[int, ...] = (404,), **kw: Any) -> httpx.Response:
        """One request; the statuses in `passed` are returned to the caller, other failures raise
        Unavailable."""
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise RegistryUnavailable(f"{method} {path}: {e!r}") from e
        if resp.status_code in (401, 403):
            raise RegistryRefused(f"{method} {path}: HTTP {resp.status_code} {resp.text} (is this process's cluster "
                                  f"token the conductor's?)")
        if resp.status_code not in passed and resp.status_code >= 300:
            raise RegistryUnavailable(f"{method} {path}: HTTP {resp.status_code} {resp.text}")
        return resp

    async def _put(self, reg: _Registration) -> None:
        body = msgspec.json.encode(Registration(reg.info, reg.ttl_s))
        await self._call("POST", "/instances", content=body,
                         headers={"content-type": "application/json"})

    # -- worker side --------------------------------------------------------------------
    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        old = self._regs.pop(info.instance_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        reg = _Registration(info, ttl_s)
        await self._put(reg)
        reg.task = asyncio.get_running_loop().create_task(
            self._keepalive(reg), name=f"registry-keepalive-{info.instance_id}")
        self._regs[info.instance_id] = reg

    async def _keepalive(self, reg: _Registration) -> None:
        failing = claimed = False
        # The heartbeat carries this process's info: one for an id another process registered
        # since (the same --instance-id twice) is refused with 409 rather than keeping that
        # process's record alive after it died (memory.py, claimed_by_another).
        mine = encode_info(reg.info)
        while True:
            await asyncio.sleep(self._config.keepalive_interval_s)
            try:
                resp = await self._call("POST", f"/instances/{reg.info.instance_id}/heartbeat", passed=(404, 409),
                                        content=mine, headers={"content-type": "application/json"})
                if resp.status_code == 409:
                    if not claimed:  # said once per claim; the entry expires with the other process
                        log.error("registry: another process registered instance id %s over this one: this one is "
                                  "not routed while that one lives; give every worker its own --instance-id",
                                  reg.info.instance_id)
                    claimed = True
                elif resp.status_code == 404:
                    log.warning("registry: conductor forgot %s; registering again",
                                reg.info.instance_id)
                    await self._put(reg)
                    claimed = False
                else:
                    claimed = False
                if failing:
                    log.info("registry: conductor reachable again")
                failing = False
            except Exception as e:  # noqa: BLE001 - this loop is the instance's liveness: it must not die
                if not failing:  # one line per outage, not one per heartbeat
                    log.warning("registry: heartbeat failed, will retry: %r", e)
                failing = True

    async def deregister(self, instance_id: str) -> None:
        reg = self._regs.pop(instance_id, None)
        if reg is not None and reg.task is not None:
            reg.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reg.task
        with contextlib.suppress(RegistryUnavailable):
            await self._call("DELETE", f"/instances/{instance_id}")

    # -- conductor side (polling; the conductor itself watches its MemoryRegistry) ------
    async def snapshot(self) -> Snapshot:
        resp = await self._call("GET", "/instances")
        if resp.status_code == 404:
            raise RegistryUnavailable("no registry routes at this url")
        try:
            listing = _LISTING.decode(resp.content)
        except msgspec.DecodeError as e:  # not our conductor, or a half-written answer
            raise RegistryUnavailable(f"GET /instances: {e}") from e
        return {info.instance_id: info for info in listing.instances}

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        last: Snapshot | None = None  # None: not in sync (start, or after an outage)
        while True:
            snap: Snapshot = {}
            async for attempt in retrying(self._config.retry_min_s, self._config.retry_max_s,
                                          RegistryUnavailable):
                with attempt:
                    snap = await self.snapshot()
                if attempt.retry_state.outcome.failed and last is not None:
                    # Before the first backoff sleep: the consumer stops trusting TTLs now.
                    yield RegistryEvent("outage")
                    last = None
            if last is None:
                yield RegistryEvent("resync", snapshot=snap)
            else:
                for ev in _diff(last, snap):
                    yield ev
            last = snap
            await asyncio.sleep(self._config.poll_interval_s)

    async def close(self) -> None:
        tasks = [r.task for r in self._regs.values() if r.task is not None]
        self._regs = {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._http.aclose()


def _diff(old: Snapshot, new: Snapshot) -> list[RegistryEvent]:
    """Events that turn `old` into `new`; every surviving instance gets an "alive" event,
    since a successful poll is proof of life."""
    events = [RegistryEvent("delete", iid) for iid in old if iid not in new]
    for iid, info in new.items():
        if old.get(iid) != info:
            events.append(RegistryEvent("put", iid, info=info))
        else:
            events.append(RegistryEvent("alive", iid))
    return events
