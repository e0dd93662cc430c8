"""One submission thread per peer, for transports whose submission may block on the network
(rdma and nixl: connecting, a handshake, asking a peer for its regions, up to `timeout_s`).

With one shared thread, a frozen peer stalled every other peer's batches behind it until they
timed out. Here it stalls only its own; batches to one peer still go in submission order. A
peer's thread ends once it has had nothing to do for `idle_s`: a worker restarted is a new peer
name, and a long-lived deployment would otherwise keep one thread per name it ever wrote to.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from messenger.api import Batch, TransferError

log = logging.getLogger(__name__)

IDLE_S = 30.0  # a peer's thread ends after this long without work; the next submit starts one


class _Lane:
    def __init__(self) -> None:
        self.work: queue.SimpleQueue[tuple[Batch | None, Callable, tuple] | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None


class PeerQueues:
    """Per-peer submission threads. `close` once; later submissions fail their batch."""

    def __init__(self, prefix: str, idle_s: float = IDLE_S) -> None:
        self._prefix = prefix  # thread names: "<prefix>-<peer>"
        self._idle_s = idle_s
        self._lock = threading.Lock()  # a lane leaves `_lanes` only under it, with nothing queued
        self._lanes: dict[str, _Lane] = {}
        self._closed = False

    def submit(self, peer: str, batch: Batch | None, run: Callable, *args) -> None:
        """Run `run(*args)` on `peer`'s thread after what was queued for it before. If the queue
        is closed, or `close` cancels it before it runs, `batch` (the one waiting on this work,
        None if none here is) fails instead of waiting forever."""
        with self._lock:
            if not self._closed:
                lane = self._lanes.get(peer)
                if lane is None:
                    lane = self._lanes[peer] = _Lane()
                    lane.thread = threading.Thread(target=self._run, args=(peer, lane), daemon=True,
                                                   name=f"{self._prefix}-{peer}")
                    lane.thread.start()
                lane.work.put((batch, run, args))
                return
        self._fail(batch, self._closed_error())

    def lanes(self) -> int:
        """How many peers have a submission thread now."""
        with self._lock:
            return len(self._lanes)

    def close(self, wait: bool) -> None:
        """Cancel what is still queued (failing its batches); `wait`: for what runs to return."""
        with self._lock:
            self._closed = True
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.work.put(None)  # after what is queued: the thread fails those (closed) and ends
        if wait:
            for lane in lanes:
                if lane.thread is not threading.current_thread():
                    lane.thread.join()

    @staticmethod
    def _fail(batch: Batch | None, error: TransferError) -> None:
        if batch is not None:
            batch.complete(error)

    def _closed_error(self) -> TransferError:
        return TransferError(f"{self._prefix} transport closed")

    def _run(self, peer: str, lane: _Lane) -> None:
        while True:
            try:
                item = lane.work.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if lane.work.empty():  # nothing came meanwhile: nobody can queue here now
                        if self._lanes.get(peer) is lane:
                            del self._lanes[peer]
                        return
                continue
            if item is None:
                return
            batch, run, args = item
            with self._lock:
                closed = self._closed
            if closed:  # closed after it was queued: fail it rather than start it
                self._fail(batch, self._closed_error())
                continue
            try:
                run(*args)
            except Exception as exc:  # noqa: BLE001 - the batch fails; the peer's thread goes on
                log.exception("%s to %r failed", self._prefix, peer)
                self._fail(batch, TransferError(f"{self._prefix} to {peer!r}: {type(exc).__name__}: {exc}"))
