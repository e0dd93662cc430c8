"""The SSD tier's files: one file per block, with a header that makes the directory its own index.

Layout: <ssd_dir>/<layout>/<first key byte>/<key>.blk, where <layout> is the xxh3-64 (hex) of
the engine's KV layout description (model, dtype, block size, layer shapes: the connector's
`layout` string), so two models, or a model restarted in another dtype, never read each
other's blocks. A file is a 64-byte header then `block_bytes` of KV:

    magic "MCKVBLK1" | version u16 | header bytes u16 | reserved u32 | key u128 (big-endian)
    | layout u64 | length u64 | checksum u64 (xxh3-64 of the data) | 8 bytes zero

Writes go to a temporary name and are renamed into place, so a crash leaves a whole file or a
*.tmp (deleted by the next scan). No fsync: this is a cache, and a file torn by a power cut
fails its length or checksum check and is a miss, never wrong bytes.

At start-up `scan()` rebuilds the index from the headers only (reading 16 GB of data would take
minutes); the data's checksum is verified on every read instead. A file whose header is not
ours (another magic, version or a name that does not match its key) is foreign: skipped with a
warning and left alone. One of ours that is truncated or of the wrong length is skipped with a
warning and deleted.

Errors are the caller's to handle (OSError from every method); the pool service turns them
into a DRAM-only pool with a warning and a counter (store/service.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import re
import struct
import threading
from stat import S_ISREG
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from store.pool import checksum

log = logging.getLogger(__name__)

MAGIC = b"MCKVBLK1"
VERSION = 1
HEADER = struct.Struct(">8sHHI16sQQQ8x")
assert HEADER.size == 64
SUFFIX = ".blk"
FREE_HEADROOM = 0.1  # of a disk's free space at start-up, left to others: a cache must not fill it
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX))
_TMP_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(SUFFIX) + r"\.\d+\.tmp")  # write()'s own temporary names


@dataclass(frozen=True)
class FoundBlock:
    key: int
    checksum: int
    mtime: float  # older files are restored first, so the LRU order survives a restart roughly


class SsdTier:
    def __init__(self, directory: str, layout: str, block_bytes: int):
        self.layout_id = xxhash.xxh3_64_intdigest(layout.encode())
        self.root = os.path.join(directory, format(self.layout_id, "016x"))
        self.block_bytes = block_bytes
        self.skipped = {"foreign": 0, "truncated": 0}
        self._lock_fd: int | None = None

    def open(self) -> None:
        """Create the directory, prove it is writable and take it for this pool (raises OSError
        if not). Two pools in one directory would each restore the other's files as their own
        and evict them, and the disk would hold twice the limit: the second is refused, while the
        first lives (the lock goes with its process)."""
        os.makedirs(self.root, exist_ok=True)
        probe = os.path.join(self.root, ".probe")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
        fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, f"{self.root} is in use by another KV pool; give each worker its own "
                                       f"--pool-ssd-dir") from None
        self._lock_fd = fd

    def close(self) -> None:
        """Let the directory go (another pool may take it)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def file_bytes(self) -> int:
        """One block file's size: the header and the block."""
        return HEADER.size + self.block_bytes

    def room_for_files(self, shared_by: int = 1) -> int | None:
        """Block files this tier may add now: its share of the disk's free space, less
        FREE_HEADROOM (None: the filesystem does not say). `shared_by` pools starting on one disk
        (serve's workers) each see the same free space: each taking all of it would claim it
        `shared_by` times over."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return int(st.f_bavail * st.f_frsize * (1 - FREE_HEADROOM) / shared_by) // self.file_bytes

    def path(self, key: int) -> str:
        name = format(key, "032x")
        return os.path.join(self.root, name[:2], name + SUFFIX)

    # --- write -----------------------------------------------------------------------------
    def write(self, key: int, data, digest: int) -> None:
        """Store one block (any buffer of block_bytes). Raises OSError (ENOSPC on a full disk)."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.block_bytes:
            raise ValueError(f"block of {view.nbytes} B, the tier stores {self.block_bytes} B blocks")
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        header = HEADER.pack(MAGIC, VERSION, HEADER.size, 0, key.to_bytes(16, "big"), self.layout_id,
                             self.block_bytes, digest)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, header)
            _write_all(fd, view)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    def delete(self, key: int) -> None:
        _unlink(self.path(key))

    # --- read ------------------------------------------------------------------------------
    def read_into(self, key: int, out, digest: int) -> bool:
        """Read block `key` into `out` (a writable buffer of block_bytes) and verify it: the
        header must name this key, layout, length and checksum, and the data must hash to it.
        False (and `out` undefined) when it does not: the caller treats it as a miss. Raises
        OSError only for an unreadable file that exists."""
        view = memoryview(out).cast("B")
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return False
        head = bytearray(HEADER.size)
        try:
            got = os.preadv(fd, [head, view], 0)  # header and data in one system call
        finally:
            os.close(fd)
        return (got == HEADER.size + self.block_bytes and self._parse(bytes(head)) == (key, digest)
                and checksum(view) == digest)

    # --- start-up --------------------------------------------------------------------------
    def other_layouts(self) -> dict[str, tuple[int, int]]:
        """Block directories of other layouts beside this one (another model, dtype or block size
        used this directory before): {path: (files, bytes)}. This engine never reads them."""
        parent, found = os.path.dirname(self.root), {}
        for entry in os.scandir(parent):
            name = entry.name
            if entry.path == self.root or len(name) != 16 or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                int(name, 16)
            except ValueError:
                continue
            files = size = 0
            for dirpath, _dirs, names in os.walk(entry.path):
                for n in names:
                    try:
                        size += os.lstat(os.path.join(dirpath, n)).st_size
                        files += 1
                    except OSError:
                        pass
            found[entry.path] = (files, size)
        return found

    def scan(self) -> list[FoundBlock]:
        """Every valid block file, oldest first (headers only; see the module's note)."""
        found = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.startswith("."):  # the tier's own .lock and .probe
                    continue
                if _TMP_NAME.fullmatch(name):
                    self._drop(path)  # a write of ours that never finished
                    continue
                block = self._check(path, name)
                if block is not None:
                    found.append(block)
        found.sort(key=lambda b: b.mtime)
        return found

    def _check(self, path: str, name: str) -> FoundBlock | None:
        try:
            stat = os.lstat(path)
            if not S_ISREG(stat.st_mode):  # a FIFO would block the open; links and devices are not ours
                self.skipped["foreign"] += 1
                log.warning("pool SSD tier: %s is not a regular file (foreign); skipped", path)
                return None
            with open(path, "rb") as f:
                head = f.read(HEADER.size)
        except OSError as exc:
            log.warning("pool SSD tier: cannot read %s (%s); skipped", path, exc)
            return None
        parsed = self._parse(head) if len(head) == HEADER.size else None
        # Ours: our magic, or our name with less than a header (a write cut short by a power loss
        # leaves an empty file; writes go to .tmp and are renamed, but the rename may reach the
        # disk before the data).
        ours = (len(head) >= len(MAGIC) and head[:len(MAGIC)] == MAGIC) or (
            len(head) < len(MAGIC) and _BLOCK_NAME.fullmatch(name) is not None)
        # Where write() puts its key, no other place: a block file moved elsewhere in the tree
        # would be restored and advertised, yet every read (by path(key)) would miss it.
        if (parsed is None or not name.endswith(SUFFIX) or format(parsed[0], "032x") != name[:-len(SUFFIX)]
                or path != self.path(parsed[0])):
            if ours and len(head) < HEADER.size:
                return self._truncated(path, stat.st_size)
            self.skipped["foreign"] += 1
            log.warning("pool SSD tier: %s is not a block file of this pool (foreign); skipped", path)
            return None
        if stat.st_size != HEADER.size + self.block_bytes:
            return self._truncated(path, stat.st_size)
        return FoundBlock(parsed[0], parsed[1], stat.st_mtime)

    def _truncated(self, path: str, size: int) -> None:
        self.skipped["truncated"] += 1
        log.warning("pool SSD tier: %s is %d B, a block file is %d B (truncated); skipped and deleted",
                    path, size, HEADER.size + self.block_bytes)
        self._drop(path)
        return None

    @staticmethod
    def _drop(path: str) -> None:
        """Delete a file the scan found to be a dead write of ours; one that cannot be deleted
        (a read-only or immutable file) is left, said, and skipped: the tier goes on."""
        try:
            _unlink(path)
        except OSError as exc:
            log.warning("pool SSD tier: cannot delete %s (%s); left in place", path, exc)

    def _parse(self, head: bytes) -> tuple[int, int] | None:
        """(key, checksum) of a header of this tier's layout and block size, else None."""
        if len(head) != HEADER.size:
            return None
        magic, version, header_len, _, key, layout, length, digest = HEADER.unpack(head)
        if (magic, version, header_len, layout, length) != (MAGIC, VERSION, HEADER.size, self.layout_id,
                                                            self.block_bytes):
            return None
        return int.from_bytes(key, "big"), digest


class SpillWriter:
    """Writes spilled blocks to the SSD tier on its own thread, so an eviction costs the caller
    one memory copy, not a disk write. Bounded by bytes queued: a spill that does not fit is
    dropped (reported as failed), which loses a cache entry, never correctness.

    Deletions go through the same queue, so the files change in the order the index decided:
    a block evicted from the tier and spilled again soon after is deleted, then written, never
    the other way round (which would lose the new file).

    `done(key, error)` is called on the writer thread after each write (error None when it
    succeeded)."""

    def __init__(self, tier: SsdTier, done: Callable[[int, OSError | None], None], max_queued_bytes: int):
        self._tier = tier
        self._done = done
        self._max = max_queued_bytes
        self._queued = 0  # bytes of writes queued
        self._pending = 0  # writes and deletions queued
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="pool-spill", daemon=True)
        self._thread.start()

    def submit(self, key: int, data: bytes, digest: int) -> bool:
        with self._lock:
            if self._queued + len(data) > self._max:
                return False
            self._queued += len(data)
            self._pending += 1
        self._queue.put((key, data, digest))
        return True

    def delete(self, key: int) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((key, None, 0))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write and deletion is done (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, data, digest = item
            if data is None:
                try:
                    self._tier.delete(key)
                except OSError as exc:
                    log.debug("pool SSD tier: deleting %x failed: %s", key, exc)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
                continue
            error = None
            try:
                self._tier.write(key, data, digest)
            except OSError as exc:
                error = exc
            try:
                self._done(key, error)
            except Exception:  # noqa: BLE001 - the writer must outlive a bad callback
                log.exception("pool SSD tier: spill callback failed")
            with self._idle:
                self._queued -= len(data)
                self._pending -= 1
                self._idle.notify_all()


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.write(fd, view)
        view = view[written:]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
