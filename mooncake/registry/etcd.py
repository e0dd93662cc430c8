"""Registry on etcd (multi-host). Key layout, with the default prefix /mooncake/v1/:

    /mooncake/v1/instances/<instance_id>  InstanceInfo JSON   attached to the instance's lease
    /mooncake/v1/load/<instance_id>       InstanceLoad JSON   attached to the same lease

Both keys are written in one transaction and die with the lease, so a crashed worker
vanishes `ttl_s` after its last keepalive without anyone cleaning up. The keepalive task
also rewrites the load key every interval: that write is the liveness signal watchers see
(a lease refresh is invisible to them).

Watching: read the whole prefix at revision R, emit "resync", watch from R+1. After any
failure (etcd down, stream broken, revision compacted) the watcher starts over with a
fresh read, which is correct whatever was missed and makes compaction harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

import aetcd
import aetcd.exceptions
import grpc

from mooncake.registry.base import (InstanceInfo, InstanceLoad, Registry, RegistryEvent,
                                    RegistryUnavailable, Snapshot, decode_info, decode_load,
                                    encode_info, encode_load)
from mooncake.registry.config import Backoff, RegistryConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC keepalive pings find a half-open TCP connection (a host that vanished) within ~15 s.
# etcd refuses pings more often than every 5 s, or on a connection with no stream open.
_GRPC_OPTIONS = MappingProxyType({
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 0,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2_000,
})
# What a call can raise when etcd or the channel fails. ValueError: gRPC's "Cannot invoke RPC
# on closed channel", when a concurrent call has just closed the shared client after its own
# failure (keepalive and publish_load run side by side).
_FAILURES = (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError, ValueError)


def _caller_cancelled() -> bool:
    """True when the running task itself is being cancelled (shutdown, deregister), as
    opposed to a library cancelling one of its own calls under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass
class _Registration:
    info: InstanceInfo
    ttl_s: int
    load: InstanceLoad
    lease_id: int | None = None
    task: asyncio.Task | None = None


class EtcdRegistry(Registry):
    """Registry backed by an etcd cluster (url etcd://host:port[,host:port...])."""

    def __init__(self, config: RegistryConfig) -> None:
        if config.scheme != "etcd":
            raise ValueError(f"EtcdRegistry needs an etcd:// url, got {config.url!r}")
        self._config = config
        self._endpoints = config.endpoints()
        self._next_endpoint = 0
        prefix = config.etcd_prefix.encode()
        self._prefix = prefix
        self._inst_prefix = prefix + b"instances/"
        self._load_prefix = prefix + b"load/"
        self._ops: aetcd.Client | None = None  # for unary calls; replaced after a failure
        self._regs: dict[str, _Registration] = {}

    # -- connections ----------------------------------------------------------------------
    def _new_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._next_endpoint % len(self._endpoints)]
        return aetcd.Client(host, port, timeout=self._config.request_timeout_s,
                            options=_GRPC_OPTIONS)

    async def _failed(self, client: aetcd.Client | None) -> None:
        """Drop a client that failed, and move to the next endpoint for the next try."""
        self._next_endpoint += 1
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._config.request_timeout_s):  # never hang the caller
                    await client.close()

    async def _run(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run one unary operation; any failure becomes RegistryUnavailable and a fresh
        channel next time (a channel to a restarted etcd may sit in gRPC backoff)."""
        if self._ops is None:
            self._ops = self._new_client()
        client = self._ops
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel.
            async with asyncio.timeout(2 * self._config.request_timeout_s):
                return await op(client)
        except (*_FAILURES, asyncio.CancelledError) as e:
            if isinstance(e, asyncio.CancelledError) and _caller_cancelled():
                raise
            # A CancelledError that is not ours: gRPC cancels calls in flight on a channel
            # that a concurrent failure has just closed. It is a failure like any other.
            if self._ops is client:
                self._ops = None
            await self._failed(client)
            raise RegistryUnavailable(f"etcd {self._config.url}: {e!r}") from e

    def _ikey(self, instance_id: str) -> bytes:
        return self._inst_prefix + instance_id.encode()

    def _lkey(self, instance_id: str) -> bytes:
        return self._load_prefix + instance_id.encode()

    # -- worker side ----------------------------------------------------------------------
    async def _grant_and_put(self, reg: _Registration) -> None:
        async def op(c: aetcd.Client) -> int:
            lease = await c.lease(reg.ttl_s)
            iid = reg.info.instance_id
            await c.transaction(compare=[], failure=[], success=[
                c.transactions.put(self._ikey(iid), encode_info(reg.info), lease.id),
                c.transactions.put(self._lkey(iid), encode_load(reg.load), lease.id)])
            return lease.id
        old, reg.lease_id = reg.lease_id, await self._run(op)
        if old is not None:  # its keys now belong to the new lease; let it go
            with contextlib.suppress(RegistryUnavailable):
                await self._run(lambda c: c.revoke_lease(old))

    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        old = self._regs.pop(info.instance_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        reg = _Registration(info, max(1, math.ceil(ttl_s)),
                            InstanceLoad(info.instance_id, updated_at=info.started_at),
                            lease_id=old.lease_id if old else None)
        await self._grant_and_put(reg)
        reg.task = asyncio.get_running_loop().create_task(
            self._keepalive(reg), name=f"registry-keepalive-{info.instance_id}")
        self._regs[info.instance_id] = reg

    async def _keepalive(self, reg: _Registration) -> None:
        failing = False
        iid = reg.info.instance_id
        while True:
            await asyncio.sleep(self._config.keepalive_interval_s)
            try:
                lease_id = reg.lease_id
                reply = None
                if lease_id is not None:
                    reply = await self._run(lambda c: c.refresh_lease(lease_id))
                if reply is None or reply.TTL <= 0:
                    # TTL 0: etcd no longer has the lease (expired while we were cut off,
                    # revoked, or a fresh etcd cluster). Start over with a new one.
                    log.warning("registry: lease of %s lost; registering again", iid)
                    await self._grant_and_put(reg)
                else:
                    await self._run(lambda c: c.put(self._lkey(iid), encode_load(reg.load),
                                                    lease=lease_id))
                if failing:
                    log.info("registry: etcd reachable again for %s", iid)
                failing = False
            except Exception as e:  # noqa: BLE001 - this loop is the instance's liveness: it must not die
                if not failing:  # one line per outage, not one per tick
                    log.warning("registry: keepalive of %s failed, will retry: %r", iid, e)
                failing = True

    async def publish_load(self, load: InstanceLoad) -> None:
        reg = self._regs.get(load.instance_id)
        if reg is None:
            raise KeyError(f"{load.instance_id!r} is not registered here")
        reg.load = load
        lease_id = reg.lease_id
        if lease_id is None:
            return
        with contextlib.suppress(RegistryUnavailable):
            await self._run(lambda c: c.put(self._lkey(load.instance_id), encode_load(load),
                                            lease=lease_id))

    async def deregister(self, instance_id: str) -> None:
        reg = self._regs.pop(instance_id, None)
        if reg is not None and reg.task is not None:
            reg.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reg.task
        with contextlib.suppress(RegistryUnavailable):
            if reg is not None and reg.lease_id is not None:
                lease_id = reg.lease_id
                await self._run(lambda c: c.revoke_lease(lease_id))  # deletes both keys
            else:
                await self._run(lambda c: c.delete(self._ikey(instance_id)))
                await self._run(lambda c: c.delete(self._lkey(instance_id)))

    # -- conductor side -------------------------------------------------------------------
    async def _read_all(self, client: aetcd.Client) -> tuple[Snapshot, int]:
        """The whole membership and the revision it was read at."""
        rng = await client.get_prefix(self._prefix)
        infos: dict[str, InstanceInfo] = {}
        loads: dict[str, InstanceLoad] = {}
        for kv in rng:
            ev = self._translate("PUT", kv.key, kv.value)
            if ev is not None and ev.kind == "put":
                infos[ev.instance_id] = ev.info  # type: ignore[assignment]
            elif ev is not None and ev.load is not None:
                loads[ev.instance_id] = ev.load
        return {iid: (info, loads.get(iid)) for iid, info in sorted(infos.items())}, \
            rng.header.revision

    def _translate(self, kind: str, key: bytes, value: bytes) -> RegistryEvent | None:
        """An etcd key change as a RegistryEvent; None for keys we do not act on. A value
        that does not decode is logged and skipped: one bad writer must not blind the
        conductor to everyone else."""
        try:
            if key.startswith(self._inst_prefix):
                iid = key[len(self._inst_prefix):].decode()
                if kind == "DELETE":
                    return RegistryEvent("delete", iid)
                return RegistryEvent("put", iid, info=decode_info(value))
            if key.startswith(self._load_prefix) and kind == "PUT":
                load = decode_load(value)
                return RegistryEvent("load", load.instance_id, load=load)
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("registry: skipping undecodable key %r: %s", key, e)
        return None  # a load key's delete always comes with its instance key's

    async def snapshot(self) -> Snapshot:
        snap, _ = await self._run(self._read_all)
        return snap

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        backoff = Backoff(self._config.retry_min_s, self._config.retry_max_s)
        synced, outage_sent = False, False
        while True:
            client = self._new_client()
            try:
                async with asyncio.timeout(2 * self._config.request_timeout_s):
                    snap, rev = await self._read_all(client)
                    stream = await client.watch_prefix(self._prefix, start_revision=rev + 1)
                backoff.reset()
                synced, outage_sent = True, False
                yield RegistryEvent("resync", snapshot=snap)
                async for ev in stream:
                    out = self._translate(str(ev.kind), ev.kv.key, ev.kv.value)
                    if out is not None:
                        yield out
                log.warning("registry: etcd watch ended; starting over")
            except aetcd.exceptions.RevisionCompactedError:
                log.info("registry: watch revision compacted; reading a fresh snapshot")
                continue  # etcd is up: re-read now, no outage, no backoff
            except _FAILURES as e:
                self._next_endpoint += 1
                if synced and not outage_sent:
                    log.warning("registry: etcd unreachable, keeping the last view: %r", e)
                    outage_sent = True
                    yield RegistryEvent("outage")
            finally:
                # Also runs when the consumer stops the iterator: the stream dies with it.
                with contextlib.suppress(Exception):
                    await client.close()
            await asyncio.sleep(backoff.next())

    async def close(self) -> None:
        tasks = [r.task for r in self._regs.values() if r.task is not None]
        self._regs = {}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ops is not None:
            ops, self._ops = self._ops, None
            with contextlib.suppress(Exception):
                await ops.close()
