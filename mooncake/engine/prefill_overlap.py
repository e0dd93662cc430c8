"""Which prompts one engine was computing at the same time.

vLLM batches the prefill of every prompt it has room for, so a prompt that arrived with others
reaches its first token only after their chunks too: its scheduled-to-first-token time measures
the burst, not the hardware. The conductor's calibration (conductor/core/calibration.py) must
learn the hardware's speed (its queue model prices the burst), so the worker says, beside each
measured prefill time, how many other prompts were in their prefill meanwhile; only the prompts
computed alone are calibration samples. Without that, one burst of 32 requests taught the
conductor a 10x scale, and it then refused long prompts on an idle cluster.

A prompt's span here is from its submission to its first output, as this process saw them:
wider than the engine's own scheduled-to-first-token, so overlaps are over- rather than
under-counted (a lost sample, never a wrong one). Pure: the caller passes the clock.
"""

from __future__ import annotations

from collections import deque


class PrefillOverlap:
    """Prompts being prefilled on one engine, and the recently finished prefills."""

    def __init__(self, history: int = 1024) -> None:
        self._open: dict[str, float] = {}  # request id -> submitted at
        self._done: deque[tuple[str, float, float]] = deque(maxlen=history)  # (id, submitted, first output)

    def submitted(self, request_id: str, now: float) -> None:
        self._open[request_id] = now

    def first_output(self, request_id: str, now: float) -> None:
        """Its prompt is computed (or it ended before that: an abort, an error). Idempotent."""
        submitted = self._open.pop(request_id, None)
        if submitted is not None:
            self._done.append((request_id, submitted, now))

    def others(self, request_id: str, start: float, end: float) -> int:
        """How many other prompts were in their prefill at some time in (start, end)."""
        count = sum(1 for rid, submitted in self._open.items() if rid != request_id and submitted < end)
        count += sum(1 for rid, submitted, first in self._done if rid != request_id and submitted < end and first > start)
        return count

    def __len__(self) -> int:
        return len(self._open)
