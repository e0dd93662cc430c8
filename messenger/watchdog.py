"""Fails what is not done by its deadline, whatever the transport does (a dead or silent peer)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time

from messenger.api import Batch, TransferError


class Watchdog:
    """One thread, one heap of (deadline, batch). `close` once."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Batch, str]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="messenger-watchdog", daemon=True)
        self._thread.start()

    def watch(self, batch: Batch, timeout_s: float, what: str) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + timeout_s, next(self._seq), batch, what))
            if self._heap[0][2] is batch:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                while self._heap and self._heap[0][2].done():
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, _, batch, what = self._heap[0]
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                self._cond.release()
                try:
                    batch.complete(TransferError(f"{what} timed out (the peer is dead or silent)"))
                finally:
                    self._cond.acquire()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
