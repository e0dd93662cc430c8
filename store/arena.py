"""The DRAM tier's memory: one shared-memory file of fixed-size slots.

The pool service (in the worker shell) creates it; vLLM's worker process maps the same file by
path, so the connector copies between the paged KV cache and the slots directly, with no hop
through the shell; the messenger registers it as a region, so other nodes read slots from it.
Slot i is bytes [i * block_bytes, (i + 1) * block_bytes). Which slot holds which block is the
pool's business (store/pool.py hands slots out); the arena only maps memory.

A plain file under /dev/shm, opened and mmapped, rather than multiprocessing.shared_memory:
Python 3.11's resource tracker unlinks a segment when ANY process that attached it exits, so
vLLM's worker ending would tear the arena from under the shell. Pages are taken only when a
slot is first written (the file is sparse). Its creator holds a lock on the file while it lives,
so a segment left by a shell that was SIGKILLed is removed by the next one to start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import logging
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "mooncake-pool-"


@dataclass(frozen=True)
class ArenaInfo:
    """What a process needs to map an arena (travels to vLLM's worker, msgspec-encodable)."""

    path: str
    block_bytes: int
    slots: int


class Arena:
    """A mapping of the arena file. `array` is the whole arena as uint8 (writable unless mapped
    read-only); `slot(i)` is slot i's view. The creator unlinks the file on close()."""

    def __init__(self, info: ArenaInfo, owner: bool, readonly: bool = False):
        self.info = info
        self._owner = owner
        self._lock_fd: int | None = None  # the creator's, locked until close() or its death
        fd = os.open(info.path, os.O_RDONLY if readonly else os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, info.slots * info.block_bytes,
                                   access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    @classmethod
    def create(cls, slots: int, block_bytes: int, directory: str | None = None) -> "Arena":
        if slots <= 0 or block_bytes <= 0:
            raise ValueError(f"an arena needs slots > 0 and block_bytes > 0, got {slots} x {block_bytes}")
        directory = directory or (SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp")
        remove_stale(directory)
        # Sized and made under a lock on the directory: two pools starting together (serve's
        # prefill and decode workers) would each see the same free space and be given it twice.
        with _directory_lock(directory):
            slots = fitting_slots(directory, slots, block_bytes)
            path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives: see remove_stale
                os.ftruncate(fd, slots * block_bytes)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        try:
            arena = cls(ArenaInfo(path, block_bytes, slots), owner=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        arena._lock_fd = fd
        return arena

    @classmethod
    def attach(cls, info: ArenaInfo, readonly: bool = False) -> "Arena":
        """Map an arena another process created (vLLM's worker maps the shell's; a pool maps a
        same-host peer's read-only, store/peer_arena.py)."""
        size = os.stat(info.path).st_size
        if size != info.slots * info.block_bytes:
            raise ValueError(f"arena {info.path} is {size} B, expected {info.slots} x {info.block_bytes} B")
        return cls(info, owner=False, readonly=readonly)

    @property
    def block_bytes(self) -> int:
        return self.info.block_bytes

    @property
    def slots(self) -> int:
        return self.info.slots

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.info.slots:
            raise IndexError(f"slot {slot} outside the arena's {self.info.slots}")
        return slot * self.info.block_bytes

    def slot(self, slot: int) -> np.ndarray:
        start = self.offset(slot)
        return self.array[start:start + self.info.block_bytes]

    def close(self) -> None:
        self.array = None  # drop the export before closing the map
        try:
            self._mmap.close()
        except BufferError:  # a view is still alive somewhere; the OS unmaps at exit
            log.debug("arena %s still has views; left mapped", self.info.path)
        if self._owner:
            try:
                os.unlink(self.info.path)
            except FileNotFoundError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


SHM_HEADROOM = 0.1
"""Share of the free shared memory an arena leaves to others (vLLM's own shared-memory queues)."""


def fitting_slots(directory: str, slots: int, block_bytes: int) -> int:
    """As many of `slots` as the filesystem has room for now. The file is sparse, so creating it
    always succeeds; a write past what tmpfs can hold kills the writer with SIGBUS (a container's
    /dev/shm is 64 MiB unless set, the pool's default 2 GiB). Fewer slots, said once, instead.
    Other arenas' pages not yet taken count as used: two pools on one host were each given the
    same free space, and filling both killed one with SIGBUS. Call under _directory_lock."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return slots
    promised = promised_bytes(directory)  # the other arenas' pages not taken yet: free now, not for us
    free = int(fs.f_bavail * fs.f_frsize * (1 - SHM_HEADROOM)) - promised
    if slots * block_bytes <= free:
        return slots
    fit = max(free, 0) // block_bytes
    room = f"{fs.f_bavail * fs.f_frsize} B free, {promised} B of it promised to other KV pools' arenas"
    if fit < 1:
        raise OSError(errno.ENOSPC, f"{directory} has {room}: less than one KV block of {block_bytes} B is left, "
                                    f"so no KVCache pool (raise the container's shm size, or lower --pool-dram-gib)")
    log.warning("KV pool: %s has room for %d of the %d blocks asked (%s); the DRAM tier is smaller "
                "(raise the container's shm size, or --pool-dram-gib to fit)", directory, fit, slots, room)
    return fit


def promised_bytes(directory: str) -> int:
    """Bytes the arenas in `directory` may still take: each file's size less what it holds (its
    pages are taken as its slots are first written)."""
    total = 0
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        try:
            st = os.stat(path)
        except OSError:
            continue  # gone meanwhile
        total += max(st.st_size - st.st_blocks * 512, 0)
    return total


@contextlib.contextmanager
def _directory_lock(directory: str):
    """An exclusive lock on the directory itself (flock on its descriptor: no lock file left
    behind), held while an arena is sized and made."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


STALE_MIN_AGE_S = 10.0
"""An arena file younger than this is never judged stale: its creator may not hold its lock yet."""


def remove_stale(directory: str) -> None:
    """Delete arena files whose creating process is gone (a shell that was SIGKILLed). The
    creator holds an exclusive lock on its file while it lives (released by the kernel when it
    dies), so this holds across PID namespaces sharing the directory (containers with a common
    /dev/shm), where the pid in the name says nothing; a file whose named pid lives here is kept
    too (a creator of an earlier version, which took no lock)."""
    for path in glob.glob(os.path.join(directory, PREFIX + "*")):
        try:
            if time.time() - os.stat(path).st_mtime < STALE_MIN_AGE_S:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its creator is alive
        finally:
            os.close(fd)
        if _pid_alive(os.path.basename(path)[len(PREFIX):].split("-", 1)[0]):
            continue  # a creator that takes no lock (an earlier version) but lives here
        try:
            os.unlink(path)
            log.info("removed arena %s left by a process that is gone", path)
        except OSError:
            pass


def _pid_alive(pid_text: str) -> bool:
    if not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
