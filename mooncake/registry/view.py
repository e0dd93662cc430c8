"""The conductor's picture of the cluster, built from registry events. Pure: no I/O, no clock.

Liveness has two layers. The backend is authoritative (etcd leases, the embedded
registry's TTL) and sends "delete" when an instance dies. The view adds its own TTL as a
safety net against a lost delete: every registered instance refreshes itself at least once
per keepalive interval (an "alive" event), so one silent for `expire_after_s` is dropped.
That net is switched off during a backend outage: silence then says nothing about the
workers, and the last view is the best the conductor has until the next "resync". It is also off
while the backend as a whole is silent (no event at all for half of expire_after_s): a frozen etcd
or a half-open connection does not always end the watch with an outage, and a conductor whose event
loop stalled hears nothing either; the workers did not all die at once. An instance dropped by
the net that turns out alive (an "alive" event for it) is restored from its last known info, since
the backend sends a "put" only when an instance (re)registers, and without one it would stay
unroutable while its lease lives.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.registry.base import InstanceInfo, RegistryEvent


@dataclass(frozen=True)
class ViewConfig:
    """Settings of ClusterView."""

    # Drop an instance after this many seconds without any event for it (while the
    # backend is reachable). Use about 2x the registry TTL: the backend should win.
    expire_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.expire_after_s <= 0:
            raise ValueError(f"expire_after_s={self.expire_after_s} must be > 0")


@dataclass(frozen=True)
class _Entry:
    info: InstanceInfo
    last_seen: float


class ClusterView:
    """Current instances and when each was last heard of. Mutated only by `apply` and `expire`."""

    def __init__(self, config: ViewConfig | None = None) -> None:
        self._config = config or ViewConfig()
        self._entries: dict[str, _Entry] = {}
        self._synced = False  # no resync seen yet: the view is empty, not "known empty"
        self._outage_since: float | None = None
        self._last_event_at: float | None = None  # when any event last arrived
        self._dropped: dict[str, InstanceInfo] = {}  # expired by the net, not deleted by the backend

    # -- mutation ----------------------------------------------------------------------
    def apply(self, event: RegistryEvent, now: float) -> None:
        """Fold one event into the view; `now` is the consumer's clock at arrival."""
        if event.kind != "outage":
            self._last_event_at = now
        if event.kind == "resync":
            snap = event.snapshot or {}
            self._entries = {iid: _Entry(info, now) for iid, info in snap.items()}
            self._synced, self._outage_since = True, None
            self._dropped.clear()
        elif event.kind == "outage":
            if self._outage_since is None:
                self._outage_since = now
        elif event.kind == "put":
            assert event.info is not None, "put event without info"
            self._entries[event.instance_id] = _Entry(event.info, now)
            self._dropped.pop(event.instance_id, None)
        elif event.kind == "delete":
            self._entries.pop(event.instance_id, None)
            self._dropped.pop(event.instance_id, None)
        elif event.kind == "alive":
            old = self._entries.get(event.instance_id)
            info = old.info if old is not None else self._dropped.pop(event.instance_id, None)
            # An instance never put stays unknown: its put (or the next resync) carries the info
            # it needs before it can be scheduled anyway.
            if info is not None:
                self._entries[event.instance_id] = _Entry(info, now)
        else:
            raise ValueError(f"unknown event kind {event.kind!r}")

    def expire(self, now: float) -> list[str]:
        """Drop instances silent for longer than expire_after_s; returns their ids.
        Does nothing during an outage, or while the registry as a whole is silent (_fresh)."""
        dead = [iid for iid, e in self._entries.items() if not self._fresh(e, now)]
        for iid in dead:
            self._dropped[iid] = self._entries.pop(iid).info
        return sorted(dead)

    # -- queries -----------------------------------------------------------------------
    @property
    def synced(self) -> bool:
        """True once a full snapshot has been applied."""
        return self._synced

    @property
    def outage_since(self) -> float | None:
        """When the backend became unreachable, or None while it is reachable."""
        return self._outage_since

    def instances(self, role: str | None = None) -> list[InstanceInfo]:
        """Every known instance (expired or not), sorted by id; `role` keeps those that
        serve it ("both" serves prefill and decode)."""
        infos = [e.info for _, e in sorted(self._entries.items())]
        return infos if role is None else [i for i in infos if i.serves(role)]

    def alive(self, now: float, role: str | None = None) -> list[InstanceInfo]:
        """Like `instances`, without those silent past expire_after_s (all kept in outage)."""
        return [i for i in self.instances(role) if self._fresh(self._entries[i.instance_id], now)]

    def get(self, instance_id: str) -> InstanceInfo | None:
        e = self._entries.get(instance_id)
        return e.info if e else None

    def last_seen(self, instance_id: str) -> float | None:
        e = self._entries.get(instance_id)
        return e.last_seen if e else None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._entries

    def _silent(self, now: float) -> bool:
        """No event at all for half of expire_after_s: the backend or the watch is silent, not
        every instance dead at once (the backend's deletes still remove the ones that die).

        Half, not all of it: the instances' refreshes are spread over a keepalive interval, so
        when the backend freezes each instance's own silence starts up to an interval before the
        backend's. Measured over the whole window, every instance but the last one heard from
        crossed expire_after_s before the backend counted as silent, and was dropped (3 of 4
        workers while etcd was stopped). A live backend with any live instance speaks at least
        once per keepalive interval (at most a quarter of expire_after_s: the interval is at most
        half the TTL, the window twice it), so half the window is silence of the backend."""
        return (self._last_event_at is not None
                and now - self._last_event_at > self._config.expire_after_s / 2)

    def _fresh(self, e: _Entry, now: float) -> bool:
        return (self._outage_since is not None or self._silent(now)
                or now - e.last_seen <= self._config.expire_after_s)
