"""Graceful drain on SIGTERM, shared by the conductor and the workers.

What a SIGTERM means here (a Kubernetes pod being deleted, `systemctl stop`, a rolling upgrade):
stop taking new work, let the work in flight finish within a grace period, then exit. uvicorn's
own SIGTERM handling closes the listening socket at once and gives open connections a few
seconds; that is too short for a generation on CPU, and a worker would stay in the registry
(and in the conductors' routing) until its lease expires. So the first SIGTERM runs the
component's `drain` coroutine first:

- a worker answers /health with 503 `draining` (the conductors' health poll stops routing to
  it within a second), refuses new generate calls with 503 (the conductor retries them on
  another worker), deregisters from the registry (every conductor's watch drops it at once),
  and waits for its in-flight requests;
- the conductor answers /health with 503 `draining` (a balancer's health check takes it out),
  keeps answering whatever still reaches it, and waits until no request is in flight.

Either way the wait ends after `grace_s`, and uvicorn's ordinary shutdown follows. A second
SIGTERM, or Ctrl-C (SIGINT), skips the drain: uvicorn's ordinary shutdown at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


@dataclass
class Drain:
    """Whether this process is draining, and since when (monotonic seconds; explicit clock)."""

    started_at: float | None = None

    @property
    def active(self) -> bool:
        return self.started_at is not None

    def begin(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now


async def wait_idle(busy: Callable[[], int], grace_s: float, poll_s: float = 0.1) -> int:
    """Wait until `busy()` (requests in flight) is 0, for at most `grace_s` seconds. Returns
    what is still in flight when the wait ends (0: drained)."""
    deadline = time.monotonic() + grace_s
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    return busy()


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM runs `drain()` before the ordinary shutdown (drain
    None: SIGTERM is the ordinary shutdown, as Ctrl-C is).

    `on_exit()` runs when the ordinary shutdown is asked for without a drain (Ctrl-C, a second
    SIGTERM, a SIGTERM with no drain): requests that wait for news (held polls) end then, and
    answers in progress end with an error, rather than holding the exit up to uvicorn's graceful
    timeout or being cut off. It runs in a signal handler: set flags only."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]] | None,
                 on_exit: Callable[[], None] | None = None):
        super().__init__(config)
        self._drain = drain
        self._on_exit = on_exit
        self._drain_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the event loop's thread: only flags and a thread-safe hand-off.
        if (sig == signal.SIGTERM and self._drain is not None and not self._drain_requested and not self.should_exit
                and self._loop):
            self._drain_requested = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        if self._on_exit is not None:
            self._on_exit()
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # noqa: BLE001 - a failed drain must still end in a shutdown
            log.exception("drain failed; shutting down now")
        finally:
            self.should_exit = True  # uvicorn's main loop notices within 0.1 s
