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
from fastapi import APIRouter, HTTPException, Request

from mooncake.registry.base import (InstanceInfo, InstanceLoad, Registry, RegistryEvent,
                                    RegistryUnavailable, Snapshot, info_from_dict,
                                    info_to_dict, load_from_dict, load_to_dict)
from mooncake.registry.config import Backoff, RegistryConfig
from mooncake.registry.memory import MemoryRegistry

log = logging.getLogger(__name__)

ROUTE_PREFIX = "/internal/registry"


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise HTTPException(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


def registry_router(registry: MemoryRegistry) -> APIRouter:
    """Internal routes over `registry`; mount with `app.include_router(...)`.

    POST   /internal/registry/instances                {"info", "ttl_s", "load"?}
    POST   /internal/registry/instances/{id}/heartbeat  404 if unknown: register again
    PUT    /internal/registry/instances/{id}/load       InstanceLoad JSON; 404 if unknown
    DELETE /internal/registry/instances/{id}
    GET    /internal/registry/instances                 {"v": 1, "instances": [...]}
    """
    router = APIRouter(prefix=ROUTE_PREFIX, tags=["internal-registry"])

    @router.post("/instances")
    async def register(request: Request) -> dict[str, Any]:
        body = await _body(request)
        try:
            info = info_from_dict(body["info"])
            ttl_s = float(body["ttl_s"])
            load = load_from_dict(body["load"]) if body.get("load") else None
            registry.put(info, ttl_s, load)
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPException(400, f"bad registration: {e!r}") from None
        return {"ok": True}

    @router.post("/instances/{instance_id}/heartbeat")
    async def heartbeat(instance_id: str) -> dict[str, Any]:
        if not registry.heartbeat(instance_id):
            raise HTTPException(404, f"unknown instance {instance_id!r}: register again")
        return {"ok": True}

    @router.put("/instances/{instance_id}/load")
    async def load(instance_id: str, request: Request) -> dict[str, Any]:
        try:
            report = load_from_dict(await _body(request))
        except ValueError as e:
            raise HTTPException(400, f"bad load: {e}") from None
        if report.instance_id != instance_id:
            raise HTTPException(400, "instance_id in path and body differ")
        if not registry.set_load(report):
            raise HTTPException(404, f"unknown instance {instance_id!r}: register again")
        return {"ok": True}

    @router.delete("/instances/{instance_id}")
    async def deregister(instance_id: str) -> dict[str, Any]:
        return {"removed": registry.remove(instance_id)}

    @router.get("/instances")
    async def list_instances() -> dict[str, Any]:
        return {"v": 1, "instances": [
            {"info": info_to_dict(info), "load": load_to_dict(ld) if ld else None}
            for info, ld in registry.list().values()]}

    return router


@dataclass
class _Registration:
    info: InstanceInfo
    ttl_s: float
    load: InstanceLoad
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
                                       timeout=config.request_timeout_s)
        self._regs: dict[str, _Registration] = {}

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request; 404 is returned to the caller, other failures raise Unavailable."""
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise RegistryUnavailable(f"{method} {path}: {e!r}") from e
        if resp.status_code != 404 and resp.status_code >= 300:
            raise RegistryUnavailable(f"{method} {path}: HTTP {resp.status_code} {resp.text}")
        return resp

    async def _put(self, reg: _Registration) -> None:
        await self._call("POST", "/instances", json={
            "info": info_to_dict(reg.info), "ttl_s": reg.ttl_s, "load": load_to_dict(reg.load)})

    # -- worker side --------------------------------------------------------------------
    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        old = self._regs.pop(info.instance_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        reg = _Registration(info, ttl_s, InstanceLoad(info.instance_id,
                                                      updated_at=info.started_at))
        await self._put(reg)
        reg.task = asyncio.get_running_loop().create_task(
            self._keepalive(reg), name=f"registry-keepalive-{info.instance_id}")
        self._regs[info.instance_id] = reg

    async def _keepalive(self, reg: _Registration) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._config.keepalive_interval_s)
            try:
                resp = await self._call("POST", f"/instances/{reg.info.instance_id}/heartbeat")
                if resp.status_code == 404:
                    log.warning("registry: conductor forgot %s; registering again",
                                reg.info.instance_id)
                    await self._put(reg)
                if failing:
                    log.info("registry: conductor reachable again")
                failing = False
            except Exception as e:  # noqa: BLE001 - this loop is the instance's liveness: it must not die
                if not failing:  # one line per outage, not one per heartbeat
                    log.warning("registry: heartbeat failed, will retry: %r", e)
                failing = True

    async def publish_load(self, load: InstanceLoad) -> None:
        reg = self._regs.get(load.instance_id)
        if reg is None:
            raise KeyError(f"{load.instance_id!r} is not registered here")
        reg.load = load
        try:
            resp = await self._call("PUT", f"/instances/{load.instance_id}/load",
                                    json=load_to_dict(load))
            if resp.status_code == 404:
                await self._put(reg)
        except RegistryUnavailable:
            pass  # kept in reg.load; the keepalive re-sends it with the next registration

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
        out: Snapshot = {}
        for item in resp.json()["instances"]:
            info = info_from_dict(item["info"])
            out[info.instance_id] = (info, load_from_dict(item["load"]) if item["load"] else None)
        return out

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        backoff = Backoff(self._config.retry_min_s, self._config.retry_max_s)
        last: Snapshot | None = None  # None: not in sync (start, or after an outage)
        down = False
        while True:
            try:
                snap = await self.snapshot()
            except RegistryUnavailable:
                if last is not None and not down:
                    yield RegistryEvent("outage")
                last, down = None, True
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            down = False
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
    """Events that turn `old` into `new`; every surviving instance gets a "load" event,
    since a successful poll is proof of life."""
    events = [RegistryEvent("delete", iid) for iid in old if iid not in new]
    for iid, (info, load) in new.items():
        if iid not in old or old[iid][0] != info:
            events.append(RegistryEvent("put", iid, info=info, load=load))
        else:
            events.append(RegistryEvent("load", iid, load=load))
    return events
