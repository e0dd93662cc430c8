"""Fails what is not done by its deadline, whatever the transport does (a dead or silent peer)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

from messenger.api import Batch, TimedOut, TransferError

log = logging.getLogger(__name__)


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
            closed = self._closed
            if not closed:
                heapq.heappush(self._heap, (time.monotonic() + timeout_s, next(self._seq), batch, what))
                if self._heap[0][2] is batch:
                    self._cond.notify()
        if closed:  # nothing would ever time it out
            _fail(batch, TransferError(f"{what}: engine closed"))

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
                    _fail(batch, TimedOut(f"{what} timed out (the peer is dead or silent)"))
                finally:
                    self._cond.acquire()

    def close(self) -> None:
        """Stop, and fail what is still watched: a batch a closing transport dropped (one still
        queued for submission) must not wait for a deadline nobody checks any more."""
        with self._cond:
            self._closed = True
            left, self._heap = self._heap, []
            self._cond.notify()
        for _, _, batch, what in left:
            _fail(batch, TransferError(f"{what}: engine closed"))


def _fail(batch: Batch, error: TransferError) -> None:
    # The thread must outlive any error here: without it no batch or call ever times out again.
    try:
        batch.complete(error)
    except Exception:
        log.exception("failing a batch raised")
