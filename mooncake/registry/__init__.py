"""Cluster registry: worker instances announce themselves; the conductor follows.

URLs understood by `open_registry` (see docs/REGISTRY.md):

    memory://                          in-process MemoryRegistry (conductor's own, tests)
    embedded+http://HOST:PORT          worker side of the conductor-hosted embedded registry
                                       (routes under /internal/registry on the conductor)
    etcd://HOST:PORT[,HOST:PORT...]    etcd cluster (multi-host)

Plain http:// is refused: it cannot say whether it means etcd or the conductor.
"""

from __future__ import annotations

from mooncake.registry.base import (InstanceInfo, Registry, RegistryEvent, RegistryRefused, RegistryUnavailable,
                                    Snapshot, decode_info, encode_info)
from mooncake.registry.config import EtcdCredentials, RegistryConfig
from mooncake.registry.memory import MemoryRegistry
from mooncake.registry.view import ClusterView, ViewConfig

__all__ = [
    "ClusterView", "EtcdCredentials", "InstanceInfo", "MemoryRegistry", "Registry", "RegistryConfig",
    "RegistryEvent", "RegistryRefused", "RegistryUnavailable", "Snapshot", "ViewConfig", "decode_info",
    "encode_info", "open_registry",
]


def open_registry(config: RegistryConfig | str) -> Registry:
    """A Registry for `config` (or a bare url with default settings). Connects lazily:
    nothing blocks here; the first call on the registry reaches the backend."""
    if isinstance(config, str):
        config = RegistryConfig(url=config)
    scheme = config.scheme
    if scheme == "memory":
        return MemoryRegistry(config)
    if scheme == "etcd":
        from mooncake.registry.etcd import EtcdRegistry  # grpc only where etcd is used
        return EtcdRegistry(config)
    if scheme in ("embedded+http", "embedded+https"):
        from mooncake.registry.http import HttpRegistryClient
        return HttpRegistryClient(config)
    raise ValueError(f"unsupported registry url {config.url!r}")  # config already checked
