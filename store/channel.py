"""The local channel between a node's pool service and the connectors of its engine.

vLLM's scheduler asks `lookup` for every new request, so a call must cost tens of microseconds,
not a connection: the client keeps one AF_UNIX connection open (standard library
`multiprocessing.connection`, HMAC handshake once, on the same kind of per-worker key as
mooncake/control.py) and each call is one msgpack message each way. Keys travel packed, 16
big-endian bytes each (they are 128-bit; msgpack integers stop at 64).

Ops (request fields -> reply fields; every reply has "ok", and "error" when not ok):
  configure  block_bytes, layout        -> arena {path, block_bytes, slots}
  lookup     keys                       -> tiers ("dram"/"ssd" per leading key held)
  reserve    keys                       -> keys, slots (DRAM slots to fill; held keys skipped)
  commit     keys, checksums (or None: the service hashes the slots) -> committed
  abort      keys                       -> {}
  read       keys                       -> keys, slots, checksums (leading keys, pinned; SSD
                                           blocks promoted first)
  release    keys                       -> {} (unpin what read pinned)
  fetch_remote peer (PeerInfo JSON), keys -> fetched (leading keys now held here)
  stats                                 -> usage, counters
  events     since                      -> seq, reset, events [[kind, key bytes, tier], ...]

Pins taken by `read` belong to the connection: if the connector dies, they are released.
release, abort and commit(wait=False) carry "noreply": the service answers nothing (a failure is
logged there), so they cost the caller no round trip; one connection keeps them in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from mooncake.control import ControlEndpoint, connect
from store.arena import ArenaInfo

KEY_BYTES = 16
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


POOL_SILENCE_BACKOFF_S = 5.0
"""After a pool call goes unanswered for its whole timeout, the client fails every call at once
for this long instead of asking again. A pool that accepts calls but never answers them (its
process frozen, swapping) would otherwise cost the full timeout on every lookup, on vLLM's
scheduler thread, and every step would stall. A failed call is a cache miss, never wrong KV."""


class PoolUnavailable(ConnectionError):
    """The pool service did not answer (not started, gone) or refused the call."""


class PoolSilent(PoolUnavailable):
    """Not asked: the pool left a call unanswered a moment ago (POOL_SILENCE_BACKOFF_S)."""


def pack_keys(keys: Sequence[int]) -> bytes:
    return b"".join(k.to_bytes(KEY_BYTES, "big") for k in keys)


def unpack_keys(blob: bytes) -> list[int]:
    if len(blob) % KEY_BYTES:
        raise ValueError(f"packed keys of {len(blob)} B are not a multiple of {KEY_BYTES}")
    return [int.from_bytes(blob[i:i + KEY_BYTES], "big") for i in range(0, len(blob), KEY_BYTES)]


def encode(message: dict[str, Any]) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> dict[str, Any]:
    message = _decoder.decode(data)
    if not isinstance(message, dict):
        raise ValueError("a pool message must be a map")
    return message


class PoolClient:
    """A connector's handle on its node's pool. Thread-safe (one call at a time on the
    connection); reconnects once if the connection broke. A call left unanswered for its timeout
    makes the next calls fail at once for `backoff_s` (POOL_SILENCE_BACKOFF_S)."""

    def __init__(self, endpoint: ControlEndpoint, timeout_s: float = 10.0,
                 backoff_s: float = POOL_SILENCE_BACKOFF_S, clock: Callable[[], float] = time.monotonic):
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._backoff_s = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._silent_until = float("-inf")  # see POOL_SILENCE_BACKOFF_S
        self._silence = ""  # what went unanswered

    def configure(self, block_bytes: int, layout: str, timeout_s: float | None = None) -> ArenaInfo:
        """Tell the pool the engine's block size and KV layout; the first call creates the
        arena. Returns where to map it (store.arena.Arena.attach). timeout_s: longer than a
        call's (the first configure rebuilds the SSD index by reading every block file's header,
        seconds for a full tier on a cold disk), since a timeout leaves the engine without the
        pool for its life."""
        reply = self._call({"op": "configure", "block_bytes": block_bytes, "layout": layout}, timeout_s)
        return ArenaInfo(**reply["arena"])

    def lookup(self, keys: Sequence[int]) -> list[str]:
        return self._call({"op": "lookup", "keys": pack_keys(keys)})["tiers"]

    def reserve(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        reply = self._call({"op": "reserve", "keys": pack_keys(keys)})
        return list(zip(unpack_keys(reply["keys"]), reply["slots"]))

    def commit(self, keys: Sequence[int], checksums: Sequence[int] | None = None, wait: bool = True) -> int | None:
        """How many were committed; with wait=False the message is only sent (a saver off the
        critical path need not wait: the next call on this client sees it applied) and None
        is returned."""
        request = {"op": "commit", "keys": pack_keys(keys), "checksums": None if checksums is None else list(checksums)}
        if not wait:
            self._send(request)
            return None
        return self._call(request)["committed"]

    def abort(self, keys: Sequence[int]) -> None:
        self._send({"op": "abort", "keys": pack_keys(keys)})

    def read(self, keys: Sequence[int]) -> list[tuple[int, int, int]]:
        """(key, slot, checksum) of the leading keys held, each pinned until release()."""
        reply = self._call({"op": "read", "keys": pack_keys(keys)})
        return list(zip(unpack_keys(reply["keys"]), reply["slots"], reply["checksums"]))

    def release(self, keys: Sequence[int]) -> None:
        """Unpin; sent without waiting for an answer (there is nothing to answer)."""
        self._send({"op": "release", "keys": pack_keys(keys)})

    def discard(self, keys: Sequence[int]) -> None:
        """Blocks a reader found failing their checksum: the pool forgets them in every tier
        (counted as corrupt). Sent without an answer, after the reader's release on this line."""
        self._send({"op": "discard", "keys": pack_keys(keys)})

    def fetch_remote(self, peer_json: bytes, keys: Sequence[int]) -> int:
        """Bring `keys` from another node's pool into this one (its PeerInfo as msgspec JSON).
        Returns how many leading keys this node holds after."""
        return self._call({"op": "fetch_remote", "peer": peer_json, "keys": pack_keys(keys)})["fetched"]

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _send(self, request: dict[str, Any]) -> None:
        """A message the service answers with nothing (release, abort, commit without wait)."""
        payload = encode({**request, "noreply": True})
        with self._lock:
            self._check_silence(request)
            for attempt in (0, 1):
                try:
                    if self._conn is None:
                        self._conn = connect(self._endpoint, self._timeout_s)
                    self._conn.send_bytes(payload)
                    return
                except (OSError, AuthenticationError) as exc:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    if attempt or self._went_silent(request, exc):
                        raise PoolUnavailable(f"pool message {request['op']!r} failed: {type(exc).__name__}: {exc}") \
                            from exc

    def _call(self, request: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        payload = encode(request)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._check_silence(request)
            for attempt in (0, 1):
                try:
                    if self._conn is None:
                        self._conn = connect(self._endpoint, timeout_s)
                    self._conn.send_bytes(payload)
                    if not self._conn.poll(timeout_s):
                        raise TimeoutError(f"no answer within {timeout_s:g} s")
                    reply = decode(self._conn.recv_bytes())
                    break
                except (OSError, EOFError, AuthenticationError) as exc:
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    if attempt or self._went_silent(request, exc):
                        raise PoolUnavailable(f"pool call {request['op']!r} failed: {type(exc).__name__}: {exc}") \
                            from exc
        if not reply.get("ok"):
            raise PoolUnavailable(f"pool refused {request['op']!r}: {reply.get('error')}")
        return reply

    def _went_silent(self, request: dict[str, Any], exc: BaseException) -> bool:
        """Whether `exc` says the pool is there but not answering (no reply, no handshake, a send
        buffer it does not drain): then calls stop for the back-off (no retry either)."""
        if not isinstance(exc, (TimeoutError, BlockingIOError)):
            return False
        self._silent_until = self._clock() + self._backoff_s
        self._silence = f"{request['op']!r} failed: {exc}"
        return True

    def _check_silence(self, request: dict[str, Any]) -> None:
        left = self._silent_until - self._clock()
        if left > 0:
            raise PoolSilent(f"pool {request['op']!r} not asked: {self._silence}; asking again in {left:.1f} s")
