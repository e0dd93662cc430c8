"""Registry on etcd (multi-host). Key layout, with the default prefix /mooncake/v1/:

    /mooncake/v1/instances/<instance_id>  InstanceInfo JSON        attached to the instance's lease
    /mooncake/v1/alive/<instance_id>      worker wall-clock time   attached to the same lease

Both keys are written in one transaction and die with the lease, so a crashed worker
vanishes `ttl_s` after its last keepalive without anyone cleaning up. The keepalive task
also rewrites the alive key every interval: that write is the liveness signal watchers see
(a lease refresh is invisible to them).

Watching: read the whole prefix at revision R, emit "resync", watch from R+1. After any
failure (etcd down, stream broken, revision compacted) the watcher starts over with a
fresh read, which is correct whatever was missed and makes compaction harmless. Reconnects
back off exponentially (mooncake/registry/retry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import grpc

from mooncake.registry.base import (InstanceInfo, Registry, RegistryEvent, RegistryRefused, RegistryUnavailable,
                                    Snapshot, decode_info, encode_info)
from mooncake.registry.config import ETCD_PASSWORD_ENV, ETCD_USER_ENV, RegistryConfig
from mooncake.registry.retry import retrying

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
# failure (a keepalive and a deregister, or two registrations, may run side by side).
_FAILURES = (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError, ValueError)


def _caller_cancelled() -> bool:
    """True when the running task itself is being cancelled (shutdown, deregister), as
    opposed to a library cancelling one of its own calls under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


_LOGIN_REFUSED = ("authentication failed", "user name is empty", "permission denied")
"""What etcd says when it refuses a login or a user's rights (a wrong password, none given)."""


def _refused_if_login(e: RegistryUnavailable) -> RegistryUnavailable:
    """RegistryRefused when etcd refused our credentials: no retry helps (found by its words:
    aetcd raises the same error types for other causes)."""
    text = str(e.__cause__ or e).lower()
    if any(words in text for words in _LOGIN_REFUSED):
        return RegistryRefused(f"{e} (check {ETCD_USER_ENV} and {ETCD_PASSWORD_ENV})")
    return e


@dataclass
class _Registration:
    info: InstanceInfo
    ttl_s: int
    lease_id: int | None = None
    task: asyncio.Task | None = None
    revision: int = 0  # the instance key's mod revision when this process last put it
    granting: int | None = None  # a lease granted whose put may have committed before a cancel
    claimed_elsewhere: bool = False  # said once: another process holds the instance key


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
        self._alive_prefix = prefix + b"alive/"
        self._ops: aetcd.Client | None = None  # for unary calls; replaced after a failure
        self._regs: dict[str, _Registration] = {}

    # -- connections ----------------------------------------------------------------------
    def _new_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._next_endpoint % len(self._endpoints)]
        login = self._config.etcd_credentials
        return aetcd.Client(host, port, timeout=self._config.request_timeout_s, options=_GRPC_OPTIONS,
                            username=login.user if login else None, password=login.password if login else None)

    async def _failed(self, client: aetcd.Client | None) -> None:
        """Drop a client that failed, and move to the next endpoint for the next try."""
        self._next_endpoint += 1
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._config.request_timeout_s):  # never hang the caller
                    await client.close()

    async def _run(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run one unary operation; any failure becomes RegistryUnavailable and a fresh
        channel next time (a channel to a restarted etcd may sit in gRPC backoff). With etcd's
        authentication on, a login token that expired (etcd's --auth-token-ttl since its last
        use) is not an outage: the operation is tried once more on a fresh client, which logs in."""
        try:
            return await self._run_once(op)
        except RegistryUnavailable as e:
            if self._config.etcd_credentials is None or not isinstance(e.__cause__, aetcd.exceptions.UnauthenticatedError):
                raise _refused_if_login(e)
        try:
            return await self._run_once(op)
        except RegistryUnavailable as e:
            raise _refused_if_login(e)

    async def _run_once(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
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

    def _akey(self, instance_id: str) -> bytes:
        return self._alive_prefix + instance_id.encode()

    @staticmethod
    def _alive_value() -> bytes:
        # Any put makes a watch event; the time only helps a human reading etcdctl output.
        return repr(time.time()).encode()

    # -- worker side ----------------------------------------------------------------------
    async def _grant_and_put(self, reg: _Registration) -> None:
        async def op(c: aetcd.Client) -> int:
            lease = await c.lease(reg.ttl_s)
            reg.granting = lease.id  # a deregister that cancels us from here on revokes it too
            iid = reg.info.instance_id
            _, responses = await c.transaction(compare=[], failure=[], success=[
                c.transactions.put(self._ikey(iid), encode_info(reg.info), lease.id),
                c.transactions.put(self._akey(iid), self._alive_value(), lease.id)])
            reg.revision = responses[0].response_put.header.revision
            return lease.id
        old, reg.lease_id = reg.lease_id, await self._run(op)
        reg.granting = None
        if old is not None:  # its keys now belong to the new lease; let it go
            with contextlib.suppress(RegistryUnavailable):
                await self._run(lambda c: c.revoke_lease(old))

    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        old = self._regs.pop(info.instance_id, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        reg = _Registration(info, max(1, math.ceil(ttl_s)), lease_id=old.lease_id if old else None)
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
                    await self._refresh(reg, lease_id)
                if failing:
                    log.info("registry: etcd reachable again for %s", iid)
                failing = False
            except Exception as e:  # noqa: BLE001 - this loop is the instance's liveness: it must not die
                if not failing:  # one line per outage, not one per tick
                    log.warning("registry: keepalive of %s failed, will retry: %r", iid, e)
                failing = True

    async def _refresh(self, reg: _Registration, lease_id: int) -> None:
        """Put the alive key, while the instance key is still the one this process put. Two
        processes with one instance id (a force-deleted pod still running elsewhere) overwrite
        each other's instance key; when the other one dies its lease takes the key with it, and
        this one, alive, was unroutable for good. A missing key is put again; one held by
        another process is said once (the other stays routed while it lives)."""
        iid = reg.info.instance_id

        async def op(c: aetcd.Client) -> tuple[bool, bool]:
            alive = c.transactions.put(self._akey(iid), self._alive_value(), lease_id)  # either way
            ours, _ = await c.transaction(compare=[c.transactions.mod(self._ikey(iid)) == reg.revision],
                                          success=[alive], failure=[alive])
            missing = not ours and await c.get(self._ikey(iid)) is None
            return ours, missing
        ours, missing = await self._run(op)
        if missing:
            log.warning("registry: the key of instance %s is gone while its lease lives (another process with the "
                        "same id ended?); registering again", iid)
            await self._grant_and_put(reg)
            reg.claimed_elsewhere = False
        elif not ours:
            if not reg.claimed_elsewhere:
                log.error("registry: another process registered instance id %s over this one: this worker is not "
                          "routed while that one lives; give every worker its own --instance-id", iid)
            reg.claimed_elsewhere = True

    async def deregister(self, instance_id: str) -> None:
        reg = self._regs.pop(instance_id, None)
        if reg is not None and reg.task is not None:
            reg.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reg.task
        leases = [] if reg is None else [x for x in (reg.granting, reg.lease_id) if x is not None]
        for lease_id in leases:  # revoking deletes both keys; one already gone is no matter
            with contextlib.suppress(RegistryUnavailable):
                await self._run(lambda c, lease_id=lease_id: c.revoke_lease(lease_id))
        if not leases:
            with contextlib.suppress(RegistryUnavailable):
                await self._run(lambda c: c.delete(self._ikey(instance_id)))
                await self._run(lambda c: c.delete(self._akey(instance_id)))

    # -- conductor side -------------------------------------------------------------------
    async def _read_all(self, client: aetcd.Client) -> tuple[Snapshot, int]:
        """The whole membership and the revision it was read at."""
        rng = await client.get_prefix(self._prefix)
        infos: dict[str, InstanceInfo] = {}
        for kv in rng:
            ev = self._translate("PUT", kv.key, kv.value)
            if ev is not None and ev.kind == "put":
                infos[ev.instance_id] = ev.info  # type: ignore[assignment]
        return dict(sorted(infos.items())), rng.header.revision

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
            if key.startswith(self._alive_prefix) and kind == "PUT":
                return RegistryEvent("alive", key[len(self._alive_prefix):].decode())
        except (ValueError, UnicodeDecodeError) as e:  # msgspec's DecodeError is a ValueError
            log.warning("registry: skipping undecodable key %r: %s", key, e)
        return None  # an alive key's delete always comes with its instance key's

    async def snapshot(self) -> Snapshot:
        snap, _ = await self._run(self._read_all)
        return snap

    async def _open_watch(self) -> tuple[aetcd.Client, Snapshot, Any]:
        """A fresh client, the membership at revision R and a watch stream from R+1."""
        client = self._new_client()
        try:
            async with asyncio.timeout(2 * self._config.request_timeout_s):
                snap, rev = await self._read_all(client)
                stream = await client.watch_prefix(self._prefix, start_revision=rev + 1)
        except BaseException:
            self._next_endpoint += 1  # try the next endpoint next time
            with contextlib.suppress(Exception):
                await client.close()
            raise
        return client, snap, stream

    async def watch(self) -> AsyncIterator[RegistryEvent]:
        synced, outage_sent = False, False
        while True:
            opened = None
            # A fresh retrying per reconnect: its backoff starts again at retry_min_s.
            async for attempt in retrying(self._config.retry_min_s, self._config.retry_max_s,
                                          _FAILURES):
                with attempt:
                    opened = await self._open_watch()
                failure = attempt.retry_state.outcome.exception()
                # A compacted revision means etcd answered: the next try reads afresh.
                down = failure is not None and not isinstance(
                    failure, aetcd.exceptions.RevisionCompactedError)
                if down and synced and not outage_sent:
                    log.warning("registry: etcd unreachable, keeping the last view: %r", failure)
                    outage_sent = True
                    yield RegistryEvent("outage")  # before the first backoff sleep
            assert opened is not None  # retrying only ends on success (or raises)
            client, snap, stream = opened
            try:
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
                if not outage_sent:
                    log.warning("registry: etcd unreachable, keeping the last view: %r", e)
                    outage_sent = True
                    yield RegistryEvent("outage")
            finally:
                # Also runs when the consumer stops the iterator: the stream dies with it.
                with contextlib.suppress(Exception):
                    await client.close()
            # Do not hammer an etcd that just dropped us; later tries back off in retrying.
            await asyncio.sleep(self._config.retry_min_s)

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
