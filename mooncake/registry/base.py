"""Cluster registry contract: who is in the cluster.

Workers announce themselves (`register`) under a lease they keep alive; the conductor reads a
`snapshot` and follows `watch`. Three backends implement the same ABC: `MemoryRegistry`
(in-process), `HttpRegistryClient` (worker processes talking to the conductor-hosted embedded
registry) and `EtcdRegistry` (multi-host).

Records are msgspec Structs with an explicit wire version (`"v": 1`, msgspec's tag field) so
that workers and conductors of different builds can share one etcd without guessing at field
names; a record with another version fails to decode.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import msgspec

from mooncake.defaults import WorkerRole

WIRE_VERSION = 1


class RegistryUnavailable(Exception):
    """The backend cannot be reached right now (etcd down, conductor restarting)."""


class RegistryRefused(RegistryUnavailable):
    """The backend answers but refuses this process's credentials (a wrong or missing etcd
    login, a wrong cluster token). Still "unavailable" to the loops that keep a live process
    going through an outage; a worker's first registration stops on it, since no retry helps."""


class InstanceInfo(msgspec.Struct, frozen=True, tag_field="v", tag=WIRE_VERSION):
    """What a worker instance is; written once at registration, immutable afterwards."""

    instance_id: str
    role: WorkerRole
    http_url: str  # the worker's internal HTTP API (generate, abort, health)
    kv_address: str  # "host:port" where the worker receives KV bytes
    model: str
    block_size: int
    kv_capacity_tokens: int
    started_at: float  # wall-clock seconds (time.time()) of the worker's start
    chunk_tokens: int = 0  # the engine's tokens per step (max_num_batched_tokens); 0: not said

    def __post_init__(self) -> None:
        # Runs on construction and on decoding (msgspec turns the error into a ValidationError).
        if not self.instance_id or "/" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without '/': {self.instance_id!r}")
        if self.role not in set(WorkerRole):  # msgspec checks the enum on decode, not in __init__
            raise ValueError(f"role must be one of {[str(r) for r in WorkerRole]}, got {self.role!r}")
        if self.block_size <= 0 or self.kv_capacity_tokens < 0 or self.chunk_tokens < 0:
            raise ValueError("block_size must be > 0, kv_capacity_tokens and chunk_tokens >= 0")

    def serves(self, role: str) -> bool:
        """True if this instance can take work of `role` ("both" serves either)."""
        return self.role == role or self.role == WorkerRole.BOTH


_INFO_DECODER = msgspec.json.Decoder(InstanceInfo)


def encode_info(info: InstanceInfo) -> bytes:
    return msgspec.json.encode(info)


def decode_info(raw: bytes | str) -> InstanceInfo:
    """Raises msgspec.DecodeError (a ValueError whose text names the field, e.g. `$.v` for
    another wire version) for a malformed record."""
    return _INFO_DECODER.decode(raw)


Snapshot = dict[str, InstanceInfo]
EventKind = Literal["put", "delete", "alive", "resync", "outage"]


@dataclass(frozen=True)
class RegistryEvent:
    """One change seen by a watcher.

    put: `info` is new or replaced (the instance (re-)registered).
    delete: the instance left (deregistered, or its lease/TTL expired).
    alive: the instance is still registered; sent at least every keepalive interval while
           it is, as the liveness refresh that ClusterView's own TTL expects.
    resync: `snapshot` is the complete current membership; replace the whole view.
    outage: the backend became unreachable; keep the last view, stop trusting TTLs, and
            wait for the next resync.
    """

    kind: EventKind
    instance_id: str = ""
    info: InstanceInfo | None = None
    snapshot: Snapshot | None = None


class Registry(abc.ABC):
    """Membership of the cluster. All methods are coroutines on the caller's event loop.

    Worker side: register, deregister. Conductor side: snapshot, watch.
    Every backend works for both sides, and `close` ends whatever either started.
    """

    @abc.abstractmethod
    async def register(self, info: InstanceInfo, ttl_s: float) -> None:
        """Announce `info` under a lease of `ttl_s` seconds and keep it alive.

        Blocks until the first write is acknowledged (raises RegistryUnavailable if the
        backend cannot be reached). Then starts a background keepalive task on the running
        loop that refreshes the lease, writes a liveness signal watchers can see, and
        re-registers by itself whenever the lease is lost or the backend forgot the instance
        (restart). The task lives until `deregister(info.instance_id)` or `close()`.
        Registering the same id again replaces the info and the lease.
        """

    @abc.abstractmethod
    async def deregister(self, instance_id: str) -> None:
        """Stop keeping `instance_id` alive and remove it now (best effort: if the backend
        is unreachable the entry still expires after its TTL). Idempotent."""

    @abc.abstractmethod
    async def snapshot(self) -> Snapshot:
        """Current membership. Raises RegistryUnavailable on outage."""

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
