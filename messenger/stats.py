"""What a transport moved and how long its requests took, as plain counters.

The messenger knows nothing of Prometheus (nor of the rest of the project): a TcpClient and a
TcpServer count into a TransportStats they share, and whoever owns them reads `snapshot()`, a
dict of numbers (the connector serves it over its control channel; the worker shell turns it
into metrics). Counting takes one lock per frame, next to a frame of at least a few kilobytes.
"""

from __future__ import annotations

import bisect
import threading

REQUEST_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds of the request latency histogram (seconds): a pushed layer takes about a
millisecond on loopback, tens over a loaded network, seconds when something is wrong."""


class TransportStats:
    """Counters since start, thread-safe (the messenger's threads and vLLM's count into it)."""

    def __init__(self, buckets: tuple[float, ...] = REQUEST_SECONDS_BUCKETS):
        self._buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0
        self._counts = [0] * (len(self._buckets) + 1)  # the last one: above every bound
        self._seconds = 0.0
        self._failures: dict[str, int] = {}

    def moved(self, sent: int = 0, received: int = 0) -> None:
        """Bytes of whole frames sent or received (either side of a connection)."""
        with self._lock:
            self._sent += sent
            self._received += received

    def request(self, seconds: float) -> None:
        """One request answered, `seconds` from its first byte sent to its reply."""
        i = bisect.bisect_left(self._buckets, seconds)  # a value equal to a bound falls in that bucket
        with self._lock:
            self._counts[i] += 1
            self._seconds += seconds

    def failed(self, kind: str) -> None:
        """One request (a transfer engine's batch) failed; `kind` says how ("timeout", "checksum",
        "transfer"), so a dashboard can tell a dead peer from corrupt bytes."""
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def snapshot(self) -> dict:
        """{sent_bytes, received_bytes, request_seconds: {le, cumulative, count, sum}, failures:
        {kind: count}}, where cumulative[i] counts the requests that took at most le[i] seconds
        (failed ones are counted in failures only)."""
        with self._lock:
            counts, seconds = list(self._counts), self._seconds
            sent, received = self._sent, self._received
            failures = dict(self._failures)
        cumulative, total = [], 0
        for n in counts[:-1]:
            total += n
            cumulative.append(total)
        return {"sent_bytes": sent, "received_bytes": received,
                "request_seconds": {"le": list(self._buckets), "cumulative": cumulative, "count": sum(counts),
                                    "sum": seconds},
                "failures": failures}
