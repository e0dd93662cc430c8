"""When a frame may skip a connection's sender thread and go out on the caller's own thread.

Both connection kinds (tcp's Stream, shm's Link) send from one thread draining a queue. A small
frame (a call or its reply) is faster sent on the thread that has it, which saves two thread
hand-offs on a call's round trip, but only when that cannot overtake anything: nothing queued and
nothing being sent. The sender thread holds `sending` while it handles an item and counts the item
done only after, so an item it has taken off the queue still counts as queued.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class SendGate:
    def __init__(self) -> None:
        self.sending = threading.Lock()  # held while a frame goes out, by either thread
        self._count_lock = threading.Lock()
        self._queued = 0  # items put and not yet handled by the sender thread

    def queued(self) -> None:
        """An item goes on the queue (call before putting it there)."""
        with self._count_lock:
            self._queued += 1

    @contextmanager
    def handling(self):
        """The sender thread handles one item it took off the queue."""
        try:
            with self.sending:
                yield
        finally:
            with self._count_lock:
                self._queued -= 1

    def try_idle(self) -> bool:
        """Take `sending` if the connection is idle (release it after sending); False: queue the item."""
        if not self.sending.acquire(blocking=False):
            return False
        if self._queued:
            self.sending.release()
            return False
        return True
