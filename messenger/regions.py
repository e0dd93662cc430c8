"""The engine's registered memory regions, by name (api.py's RegionTable protocol): transports
look a slice's region up here for every batch."""

from __future__ import annotations

import threading

from messenger.api import Region, TransferError


class RegionTable:
    """Registered regions by name (thread-safe)."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def add(self, region: Region) -> None:
        with self._lock:
            if region.name in self._regions:
                raise ValueError(f"region {region.name!r} is already registered")
            self._regions[region.name] = region

    def remove(self, name: str) -> None:
        with self._lock:
            if self._regions.pop(name, None) is None:
                raise KeyError(f"no region {name!r}")

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise TransferError(f"no region {name!r} is registered here")
        return region

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())
