"""Gets from a pool on the same host, straight out of its arena.

Two pools on one machine (a prefill and a decode worker of the embedded cluster, or two workers
of one node) share /dev/shm, where each keeps its DRAM tier (store/arena.py). Fetching a block
from such a peer needs no socket for the bytes: one call pins the blocks there and answers their
slots and the arena's identity; this side maps that arena read-only (once per peer), copies the
slots into its own, checks every block's checksum, and the pins go back with the next call to
that peer, or after RELEASE_AFTER_S when none comes. Over a socket the same get costs the
kernel's copy through loopback on both sides (RESULTS.md, "KVCache pool").

Used only when the peer's messenger says it is on this host (`PeerInfo.host_id`: boot id and
network namespace) and the file this side opens by the peer's path is the peer's (device and
inode match): a container with its own /dev/shm, or another user's file, falls back to the
socket. A wrong mapping could not serve wrong bytes anyway: each block is verified.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from store.arena import Arena, ArenaInfo

log = logging.getLogger(__name__)

RELEASE_AFTER_S = 0.05  # pins not carried by a next call are sent back on their own after this


class NotMappable(Exception):
    """The peer's arena cannot be mapped from here (another /dev/shm, another user, gone)."""


def describe(arena: Arena) -> dict:
    """What a pin reply says of the holder's arena, for a same-host reader to map it."""
    st = os.stat(arena.info.path)
    return {"path": arena.info.path, "block_bytes": arena.info.block_bytes, "slots": arena.info.slots,
            "dev": st.st_dev, "ino": st.st_ino}


class PeerArenas:
    """The arenas of same-host peers, mapped read-only, one per peer; and which peers cannot be.

    A peer that restarts comes back under a new name (its pid is in it) with a new arena; the old
    mapping would hold the dead arena's pages, unlinked but still allocated in /dev/shm, for the
    life of this process. So when a new arena is mapped, those whose file is gone are unmapped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mapped: dict[str, tuple[Arena, tuple[int, int]]] = {}  # peer -> (arena, its file's dev and inode)
        self._refused: set[str] = set()

    def refused(self, peer: str) -> bool:
        return peer in self._refused

    def get(self, peer: str, described: dict) -> Arena:
        """The peer's arena as `described` by its pin reply. Raises NotMappable (and remembers it)."""
        info = ArenaInfo(described["path"], described["block_bytes"], described["slots"])
        with self._lock:
            arena, _ = self._mapped.get(peer, (None, None))
            if arena is not None and arena.info == info:
                return arena
            try:
                st = os.stat(info.path)
                if (st.st_dev, st.st_ino) != (described["dev"], described["ino"]):
                    raise NotMappable(f"{info.path} here is not {peer}'s arena (another /dev/shm)")
                fresh = Arena.attach(info, readonly=True)
            except (OSError, ValueError) as exc:
                self._refused.add(peer)
                log.info("KV pool: %s's arena cannot be mapped from here (%s); its blocks come over the socket",
                         peer, exc)
                raise NotMappable(str(exc)) from None
            except NotMappable:
                self._refused.add(peer)
                raise
            if arena is not None:  # the peer restarted with a new arena
                arena.close()
            self._mapped[peer] = (fresh, (st.st_dev, st.st_ino))
            self._unmap_gone(keep=peer)
            return fresh

    def _unmap_gone(self, keep: str) -> None:
        """Close the mappings whose arena file was removed (its pool ended) or replaced."""
        for name, (arena, identity) in list(self._mapped.items()):
            if name == keep:
                continue
            try:
                st = os.stat(arena.info.path)
                gone = (st.st_dev, st.st_ino) != identity
            except OSError:
                gone = True
            if gone:
                del self._mapped[name]
                arena.close()

    def mapped(self) -> list[str]:
        with self._lock:
            return sorted(self._mapped)

    def close(self) -> None:
        with self._lock:
            arenas, self._mapped = [a for a, _ in self._mapped.values()], {}
        for arena in arenas:
            arena.close()


class PendingReleases:
    """Leases on a peer's blocks that this side is done with: carried by the next call to that
    peer (`take`), or handed to `send` after RELEASE_AFTER_S if no call comes."""

    def __init__(self, send: Callable[[str, list[int]], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._pending: dict[str, list[int]] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._closed = False

    def add(self, peer: str, lease: int) -> None:
        with self._lock:
            if self._closed:
                return  # after close: the peer's lease runs out on its own
            self._pending.setdefault(peer, []).append(lease)
            if peer not in self._timers:
                timer = self._timers[peer] = threading.Timer(RELEASE_AFTER_S, self._flush, [peer])
                timer.daemon = True
                timer.start()

    def take(self, peer: str) -> list[int]:
        with self._lock:
            return self._pending.pop(peer, [])

    def close(self) -> dict[str, list[int]]:
        """Stop; returns what was still pending, per peer, for the owner to send if it can."""
        with self._lock:
            self._closed = True
            timers, self._timers = list(self._timers.values()), {}
            pending, self._pending = self._pending, {}
        for timer in timers:
            timer.cancel()
        return pending

    def _flush(self, peer: str) -> None:
        with self._lock:
            self._timers.pop(peer, None)
            leases = self._pending.pop(peer, []) if not self._closed else []
        if leases:
            try:
                self._send(peer, leases)
            except Exception as exc:  # noqa: BLE001 - e.g. the owner closing: the leases expire there
                log.debug("releasing leases %s on %s failed: %s", leases, peer, exc)
