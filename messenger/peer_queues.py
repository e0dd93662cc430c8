"""One submission thread per peer, for transports whose submission may block on the network
(rdma and nixl: connecting, a handshake, asking a peer for its regions, up to `timeout_s`).

With one shared thread, a frozen peer stalled every other peer's batches behind it until they
timed out. Here it stalls only its own; batches to one peer still go in submission order. A
peer's thread lives as long as the transport (peers are the workers of one deployment: few).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from messenger.api import Batch, TransferError


class PeerQueues:
    """Per-peer single-thread executors. `close` once; later submissions fail their batch."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # thread names: "<prefix>-<peer>"
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._closed = False

    def submit(self, peer: str, batch: Batch, run: Callable, *args) -> None:
        """Run `run(*args)` on `peer`'s thread after what was queued for it before. If the queue
        is closed, or `close` cancels it before it runs, `batch` fails instead of waiting forever."""
        closed = TransferError(f"{self._prefix} transport closed")
        with self._lock:
            pool = None if self._closed else self._pools.get(peer)
            if pool is None and not self._closed:
                pool = self._pools[peer] = ThreadPoolExecutor(1, thread_name_prefix=f"{self._prefix}-{peer}")
        if pool is None:
            batch.complete(closed)
            return
        try:
            future = pool.submit(run, *args)
        except RuntimeError:  # close shut it down meanwhile
            batch.complete(closed)
            return

        def cancelled(done: Future) -> None:
            if done.cancelled():
                batch.complete(closed)

        future.add_done_callback(cancelled)

    def close(self, wait: bool) -> None:
        """Cancel what is still queued (failing its batches); `wait`: for what runs to return."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        if wait:
            for pool in pools:
                pool.shutdown(wait=True)
