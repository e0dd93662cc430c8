"""Cluster registry contract: who is in the cluster, and how loaded each one is.

Workers announce themselves (`register`) under a lease they keep alive, and publish their
load; the conductor reads a `snapshot` and follows `watch`. Three backends implement the
same ABC: `MemoryRegistry` (in-process), `HttpRegistryClient` (worker processes talking to
the conductor-hosted embedded registry) and `EtcdRegistry` (multi-host).

Wire encoding is explicit and versioned (`"v": 1`) so that workers and conductors of
different builds can share one etcd without guessing at field names.
"""

from __future__ import annotations

import abc
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")
WIRE_VERSION = 1


class RegistryUnavailable(Exception):
    """The backend cannot be reached right now (etcd down, conductor restarting)."""


@dataclass(frozen=True)
class InstanceInfo:
    """What a worker instance is; written once at registration, immutable afterwards."""

    instance_id: str
    role: Role
    http_url: str  # the worker's internal HTTP API (generate, abort, health)
    kv_address: str  # "host:port" where the worker receives KV bytes
    model: str
    block_size: int
    kv_capacity_tokens: int
    started_at: float  # wall-clock seconds (time.time()) of the worker's start

    def __post_init__(self) -> None:
        if not self.instance_id or "/" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without '/': {self.instance_id!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.block_size <= 0 or self.kv_capacity_tokens < 0:
            raise ValueError("block_size must be > 0 and kv_capacity_tokens >= 0")

    def serves(self, role: str) -> bool:
        """True if this instance can take work of `role` ("both" serves either)."""
        return self.role == role or self.role == "both"


@dataclass(frozen=True)
class InstanceLoad:
    """A worker's load report. New fields must get defaults so old writers still decode."""

    instance_id: str
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    kv_tokens_used: int = 0
    updated_at: float = 0.0  # worker wall clock when measured


_INFO_FIELDS = ("instance_id", "role", "http_url", "kv_address", "model", "block_size",
                "kv_capacity_tokens", "started_at")
_LOAD_FIELDS = ("instance_id", "queued_prefill_tokens", "running_requests", "waiting_requests",
                "kv_tokens_used", "updated_at")
_INT_LOAD_FIELDS = _LOAD_FIELDS[1:5]


def info_to_dict(info: InstanceInfo) -> dict[str, Any]:
    return {"v": WIRE_VERSION, **{f: getattr(info, f) for f in _INFO_FIELDS}}


def info_from_dict(d: Mapping[str, Any]) -> InstanceInfo:
    _check_version(d)
    try:
        return InstanceInfo(
            instance_id=str(d["instance_id"]), role=d["role"], http_url=str(d["http_url"]),
            kv_address=str(d["kv_address"]), model=str(d["model"]),
            block_size=int(d["block_size"]), kv_capacity_tokens=int(d["kv_capacity_tokens"]),
            started_at=float(d["started_at"]))
    except KeyError as e:
        raise ValueError(f"InstanceInfo is missing field {e.args[0]!r}") from None


def load_to_dict(load: InstanceLoad) -> dict[str, Any]:
    return {"v": WIRE_VERSION, **{f: getattr(load, f) for f in _LOAD_FIELDS}}


def load_from_dict(d: Mapping[str, Any]) -> InstanceLoad:
    _check_version(d)
    if "instance_id" not in d:
        raise ValueError("InstanceLoad is missing field 'instance_id'")
    # Unknown fields are ignored and missing counters default to 0: a newer worker may
    # report more, an older one less, and neither should break the conductor.
    kwargs: dict[str, Any] = {f: int(d[f]) for f in _INT_LOAD_FIELDS if f in d}
    return InstanceLoad(instance_id=str(d["instance_id"]),
                        updated_at=float(d.get("updated_at", 0.0)), **kwargs)


def encode_info(info: InstanceInfo) -> bytes:
    return json.dumps(info_to_dict(info), separators=(",", ":")).encode()


def decode_info(raw: bytes | str) -> InstanceInfo:
    return info_from_dict(_loads(raw))


def encode_load(load: InstanceLoad) -> bytes:
    return json.dumps(load_to_dict(load), separators=(",", ":")).encode()


def decode_load(raw: bytes | str) -> InstanceLoad:
    return load_from_dict(_loads(raw))


def _loads(raw: bytes | str) -> Mapping[str, Any]:
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object")
    return d


def _check_version(d: Mapping[str, Any]) -> None:
    if d.get("v") != WIRE_VERSION:
        raise ValueError(f"unsupported wire version {d.get('v')!r} (this build reads "
                         f"{WIRE_VERSION})")


Snapshot = dict[str, tuple[InstanceInfo, InstanceLoad | None]]
EventKind = Literal["put", "delete", "load", "resync", "outage"]


@dataclass(frozen=True)
class RegistryEvent:
    """One change seen by a watcher.

    put: `info` is new or replaced (the instance (re-)registered).
    delete: the instance left (deregistered, or its lease/TTL expired).
    load: `load` is the instance's latest load report; also sent as a liveness refresh
          at least every keepalive interval while the instance is registered.
    resync: `snapshot` is the complete current membership; replace the whole view.
    outage: the backend became unreachable; keep the last view, stop trusting TTLs, and
            wait for the next resync.
    """

    kind: EventKind
    instance_id: str = ""
    info: InstanceInfo | None = None
    load: InstanceLoad | None = None
    snapshot: Snapshot | None = None


class Registry(abc.ABC):
    """Membership of the cluster. All methods are coroutines on the caller's event loop.

    Worker side: register, publish_load, deregister. Conductor side: snapshot, watch.
    Every backend works for both sides, and `close` ends whatever either started.
    """

    @abc.abstractmethod
    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        """Announce `info` under a lease of `ttl_s` seconds and keep it alive.

        Blocks until the first write is acknowledged (raises RegistryUnavailable if the
        backend cannot be reached). Then starts a background keepalive task on the running
        loop that refreshes the lease, rewrites the latest load as a liveness signal, and
        re-registers by itself whenever the lease is lost or the backend forgot the instance
        (restart). The task lives until `deregister(info.instance_id)` or `close()`.
        Registering the same id again replaces the info and the lease.
        """

    @abc.abstractmethod
    async def publish_load(self, load: InstanceLoad) -> None:
        """Record `load` for a registered instance and try to write it once.

        Never raises for a backend outage: the latest load is kept and written again by the
        keepalive task once the backend is back. Raises KeyError if the instance was never
        registered through this object.
        """

    @abc.abstractmethod
    async def deregister(self, instance_id: str) -> None:
        """Stop keeping `instance_id` alive and remove it now (best effort: if the backend
        is unreachable the entry still expires after its TTL). Idempotent."""

    @abc.abstractmethod
    async def snapshot(self) -> Snapshot:
        """Current membership with the latest loads. Raises RegistryUnavailable on outage."""

    @abc.abstractmethod
    def watch(self) -> AsyncIterator[RegistryEvent]:
        """Follow membership changes; the iterator never ends by itself.

        The first event is always a "resync" with the full snapshot, so a consumer needs
        nothing else to build its view. On a backend outage it emits one "outage" event,
        retries with backoff, and emits a fresh "resync" once the backend answers again.
        Cancel the consuming task (or `aclose()` the iterator) to stop it.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop keepalive tasks and release connections. Does NOT deregister: entries it
        kept alive expire after their TTL (call `deregister` first for a clean exit)."""
