"""Configuration of the registry component (one frozen dataclass, checked on creation)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# Schemes `open_registry` understands. Plain http:// is refused on purpose: it could mean
# etcd's own HTTP port or the conductor, and guessing wrong fails in confusing ways.
SCHEMES = ("memory", "etcd", "embedded+http", "embedded+https")
MAX_TTL_S = 3600.0
"""The longest registration TTL: a dead instance registered with a larger one would stay listed
for as long (the conductors' health polls keep it unrouted, but every resync brings it back)."""


ETCD_USER_ENV, ETCD_PASSWORD_ENV = "MOONCAKE_ETCD_USER", "MOONCAKE_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdCredentials:
    """An etcd user (etcd's own authentication: `etcdctl user add`, `etcdctl auth enable`)."""

    user: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user or not self.password:
            raise ValueError(f"etcd credentials need both {ETCD_USER_ENV} and {ETCD_PASSWORD_ENV}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "EtcdCredentials | None":
        """From MOONCAKE_ETCD_USER and MOONCAKE_ETCD_PASSWORD (the command line's edge); None
        when neither is set."""
        user, password = environ.get(ETCD_USER_ENV, ""), environ.get(ETCD_PASSWORD_ENV, "")
        return cls(user, password) if user or password else None


@dataclass(frozen=True)
class RegistryConfig:
    """How to reach the registry and how fast liveness is tracked."""

    # memory:// | etcd://host:port[,host:port...] | embedded+http://conductor-host:port
    url: str = "memory://"
    # Seconds after the last keepalive before an instance disappears by itself.
    ttl_s: float = 5.0
    # How often a worker refreshes its lease; several refreshes must fit in one TTL.
    keepalive_interval_s: float = 1.0
    # Deadline of one request to the backend (etcd RPC or conductor HTTP call).
    request_timeout_s: float = 2.0
    # Reconnect backoff of watchers (registry/retry.py): starts at min, doubles up to max.
    # Keepalives do not back off: they tick every keepalive_interval_s, outage or not.
    retry_min_s: float = 0.1
    retry_max_s: float = 2.0
    # etcd key prefix; instances live under <prefix>instances/, liveness under <prefix>alive/.
    etcd_prefix: str = "/mooncake/v1/"
    # How often a polling watcher (embedded+http) lists the conductor's registry.
    poll_interval_s: float = 0.5
    # The cluster token the embedded registry (on the conductor) asks for (mooncake/auth.py).
    # etcd has its own authentication (users, TLS): see docs/SECURITY.md.
    cluster_token: str | None = field(default=None, repr=False)
    # The etcd user our processes log in as, when etcd's authentication is enabled.
    etcd_credentials: EtcdCredentials | None = None

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in SCHEMES:
            raise ValueError(f"registry url {self.url!r}: scheme must be one of "
                             f"{', '.join(s + '://' for s in SCHEMES)}")
        if scheme != "memory":
            self.endpoints()  # raises with the offending part
        if self.ttl_s < 1.0:
            raise ValueError(f"ttl_s={self.ttl_s}: etcd leases are whole seconds, use >= 1 (and at least twice "
                             f"the keepalive interval)")
        if not self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"ttl_s={self.ttl_s}: at most {MAX_TTL_S:g} s (a dead instance stays listed that long)")
        if not 0 < self.keepalive_interval_s <= self.ttl_s / 2:
            raise ValueError(f"a TTL of {self.ttl_s:g} s is too short for a keepalive every "
                             f"{self.keepalive_interval_s:g} s: use a TTL of at least "
                             f"{2 * self.keepalive_interval_s:g} s, so that one lost refresh is survivable")
        if self.request_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("request_timeout_s and poll_interval_s must be > 0")
        if not 0 < self.retry_min_s <= self.retry_max_s:
            raise ValueError("need 0 < retry_min_s <= retry_max_s")
        if not (self.etcd_prefix.startswith("/") and self.etcd_prefix.endswith("/")):
            raise ValueError(f"etcd_prefix={self.etcd_prefix!r} must start and end with '/'")

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    def endpoints(self) -> list[tuple[str, int]]:
        """The host:port list of an etcd:// or embedded+http:// url."""
        netloc = urlsplit(self.url).netloc
        if not netloc:
            raise ValueError(f"registry url {self.url!r} needs host:port")
        out = []
        for part in netloc.split(","):
            host, _, port = part.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"registry url {self.url!r}: bad endpoint {part!r}")
            out.append((host, int(port)))
        return out

