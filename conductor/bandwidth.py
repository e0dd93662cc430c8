"""Measured KV push bandwidth of one prefill worker, from its connector's cumulative counters.

The scheduler prices a KV transfer as bytes / bandwidth. The worker's connector counts the bytes
it pushed and the seconds its pushes took (checksum, send and acknowledgement, per layer); the
conductor samples those totals and keeps an exponential average of bytes/second over each
interval that moved enough bytes to mean something. Pure: the caller passes the counters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PushBandwidthMeter:
    min_bytes: int = 1 << 20
    """An interval counts once this many bytes were pushed in it (small pushes are all latency)."""
    weight: float = 0.3
    """Weight of the newest interval in the average."""
    estimate_Bps: float | None = None
    _bytes: int | None = None
    _seconds: float = 0.0

    def update(self, total_bytes: int, total_seconds: float) -> float | None:
        """Feed the worker's totals; returns the current estimate (None until measured)."""
        if self._bytes is None or total_bytes < self._bytes or total_seconds < self._seconds:
            # First sample, or the worker restarted and its counters began again from zero.
            self._bytes, self._seconds = total_bytes, total_seconds
            if total_bytes >= self.min_bytes and total_seconds > 0:
                self.estimate_Bps = total_bytes / total_seconds
            return self.estimate_Bps
        moved, took = total_bytes - self._bytes, total_seconds - self._seconds
        if moved >= self.min_bytes and took > 0:
            sample = moved / took
            self.estimate_Bps = sample if self.estimate_Bps is None else \
                (1 - self.weight) * self.estimate_Bps + self.weight * sample
            self._bytes, self._seconds = total_bytes, total_seconds
        return self.estimate_Bps
