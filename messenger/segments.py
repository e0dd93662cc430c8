"""Named POSIX shared-memory segments: the shm transport's way when cross-memory attach is not
permitted (messenger/cma.py).

A region that lives in a segment can be mapped by a peer on the same host, which then copies
into or out of it itself: one copy. Region owners that want this allocate their memory as a
`SharedBuffer`; any other `/dev/shm` mapping works too (the pool's arena, a file under /dev/shm;
multiprocessing.shared_memory's, torch's), because `segment_of` finds a region's segment from
the kernel's own list of this process's mappings rather than from a table someone must keep.
The decode staging arena is not one: it is private memory (`numpy.empty`, decode/kv_receiver.py).
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from dataclasses import dataclass

import numpy as np

SHM_DIR = "/dev/shm"  # where Linux mounts POSIX shared memory (shm_open's names live here)


@dataclass(frozen=True)
class SegmentSpan:
    """Where a region lies in a segment: the segment's name and the region's offset in it."""

    name: str
    offset: int


class SharedBuffer:
    """A named shared-memory segment mapped read-write here; peers map it by `name`.

    The creator unlinks the name on `close` (mappings already made stay valid until unmapped).
    `array` is a uint8 numpy view for `TransferEngine.register`.
    """

    def __init__(self, size: int, name: str | None = None, *, create: bool = True):
        if create and size <= 0:
            raise ValueError(f"SharedBuffer size must be positive, got {size}")
        self.name = name or f"mooncake-{secrets.token_hex(8)}"
        if "/" in self.name or not self.name:
            raise ValueError(f"bad segment name {self.name!r}")
        self._owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(os.path.join(SHM_DIR, self.name), flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                os.unlink(os.path.join(SHM_DIR, self.name))
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def attach(cls, name: str) -> SharedBuffer:
        """Map an existing segment (a peer's); closing it does not unlink the name."""
        return cls(0, name, create=False)

    @property
    def address(self) -> int:
        return self.array.ctypes.data

    def close(self) -> None:
        if self._owner:
            self._owner = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
        self.array = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view someone still holds keeps the mapping; it goes with the view
            pass

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def segment_of(address: int, length: int) -> SegmentSpan | None:
    """The `/dev/shm` segment that holds [address, address + length) in this process, from
    /proc/self/maps; None when the range is private memory or a deleted segment."""
    prefix = SHM_DIR + "/"
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith(prefix):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address and address + length <= end:
                path = fields[5].rstrip("\n")
                if path.endswith(" (deleted)") or "s" not in fields[1]:  # gone, or a private copy
                    return None
                return SegmentSpan(path[len(prefix):], address - start + int(fields[2], 16))
    return None


class PeerSegments:
    """Peers' segments mapped here, each once, until `close`."""

    def __init__(self) -> None:
        self._maps: dict[str, SharedBuffer] = {}
        self._lock = threading.Lock()

    def address(self, span: SegmentSpan, length: int) -> int:
        """The local address of `length` bytes at `span`; raises ValueError beyond the segment."""
        with self._lock:
            buf = self._maps.get(span.name)
            if buf is None:
                buf = self._maps[span.name] = SharedBuffer.attach(span.name)
        if span.offset < 0 or span.offset + length > buf.size:
            raise ValueError(f"[{span.offset}, {span.offset + length}) is outside segment {span.name!r} "
                             f"of {buf.size} B")
        return buf.address + span.offset

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for buf in maps.values():
            buf.close()
