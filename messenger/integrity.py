"""Checksums of the bytes a batch moves: xxh3-64 per slice, hashed off the caller's thread.

The sending engine hands its transport a `PendingMessage` whose `checksums` are still being
computed while the bytes already move; a transport reads them when it sends the message, after
the slices. The receiving engine recomputes them over its own memory (`SliceHasher.verify`) before
it tells its user the batch landed. A mismatch is reported as text starting with
CHECKSUM_ERROR_PREFIX, which a transport passes back into the sender's TransferError.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from messenger.api import OutgoingMessage, Region, Slice, TransferError

CHECKSUM_ERROR_PREFIX = "ChecksumError"
# Below this many bytes a batch is hashed on the transport's thread (xxh3 of 1 MiB takes ~50 us, a
# pool hop on a loaded machine as long or longer); below the second, in one pool task, not split.
INLINE_HASH_BYTES = 1 << 20
PARALLEL_HASH_BYTES = 8 << 20


def slice_checksums(views: list[memoryview]) -> tuple[int, ...]:
    return tuple(xxhash.xxh3_64_intdigest(v) for v in views)


class PendingMessage(OutgoingMessage):
    """An OutgoingMessage whose checksums are still being computed: reading `checksums` waits
    for them (transports read it when they send the message, after the slices). `checksums` is a
    Future (hashed on the engine's pool) or a function, run once by the first thread that reads
    them: for a small batch, the transport's sender thread, which costs less than a pool hop."""

    def __init__(self, payload: bytes, checksums: "Future | Callable[[], tuple[int, ...]]") -> None:
        object.__setattr__(self, "payload", payload)
        object.__setattr__(self, "_source", checksums)
        object.__setattr__(self, "_value", None)
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def checksums(self) -> tuple[int, ...]:  # type: ignore[override]
        if isinstance(self._source, Future):
            return self._source.result()
        with self._lock:
            if self._value is None:
                object.__setattr__(self, "_value", self._source())
            return self._value


class SliceHasher:
    """Hashes slices on its own small pool (xxh3 releases the GIL, so the threads overlap the
    sockets and each other). One per engine; `close` once."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"messenger-hash-{name}")

    def outgoing(self, envelope: bytes, views: list[memoryview]) -> PendingMessage:
        """The message of a WRITE of `views`, its checksums computed while the bytes move."""
        if sum(v.nbytes for v in views) < INLINE_HASH_BYTES:
            return PendingMessage(envelope, lambda: slice_checksums(views))
        return PendingMessage(envelope, self.hash(views))

    def hash(self, views: list[memoryview]) -> Future:
        if sum(v.nbytes for v in views) < PARALLEL_HASH_BYTES or len(views) == 1:
            return self._pool.submit(slice_checksums, views)
        # One task per thread, each over every n-th slice; merged in order when all are done.
        n = self._threads
        parts = [self._pool.submit(slice_checksums, views[i::n]) for i in range(n)]
        merged: Future = Future()

        def gather(_: Future) -> None:
            if merged.done() or not all(p.done() for p in parts):
                return
            try:
                results = [p.result() for p in parts]
            except BaseException as exc:  # noqa: BLE001 (handed to the waiter)
                merged.set_exception(exc)
                return
            out = [0] * len(views)
            for i, result in enumerate(results):
                out[i::n] = result
            try:
                merged.set_result(tuple(out))
            except Exception:  # another part's callback won the race
                pass

        for p in parts:
            p.add_done_callback(gather)
        return merged

    def verify(self, slices: list[Slice], checksums: tuple[int, ...], region: Callable[[str], Region]) -> str | None:
        """None if the slices' bytes in this process's regions hash to `checksums`, else why not."""
        if len(checksums) != len(slices):
            return f"{CHECKSUM_ERROR_PREFIX}: {len(checksums)} checksums for {len(slices)} slices"
        try:
            views = []
            for s in slices:
                r = region(s.remote_region)
                r.check(s.remote_offset, s.length)
                if r.view is None:
                    return None  # device memory: the transport that reached it vouches for it
                views.append(r.view[s.remote_offset:s.remote_offset + s.length])
        except TransferError as exc:
            return str(exc)
        if sum(v.nbytes for v in views) < INLINE_HASH_BYTES:
            actual = slice_checksums(views)  # on this (transport) thread: cheaper than a pool hop
        else:
            actual = self.hash(views).result()
        for i, (want, got) in enumerate(zip(checksums, actual)):
            if want != got:
                s = slices[i]
                return (f"{CHECKSUM_ERROR_PREFIX}: slice {i} ({s.length} B into {s.remote_region!r} at "
                        f"{s.remote_offset}) arrived with xxh3 {got:016x}, sent as {want:016x}")
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
