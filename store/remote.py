"""Remote gets: nodes read blocks from each other's pools through the messenger.

The arena is a registered region of this node's TransferEngine. A fetch of k blocks from a
peer is:
- large (k x block_bytes above INLINE_BYTES): one `call` that looks the keys up on the peer and
  pins the leading ones held (promoting SSD blocks), one one-sided `read` of their slots
  straight into slots reserved here (adjacent slots coalesced into one slice), then an unpin
  sent without waiting (the peer also drops pins whose lease ran out: a fetcher that died
  holds nothing for long);
- small: one `call` whose reply carries the bytes (a round trip and two copies cost less than
  two round trips at 64 KiB).
Every block is verified against the checksum the peer's index holds before it is committed
here; one that fails is dropped (counted), never served. The messenger's own per-slice
checksums are off by default for the pool's engine: every block already carries one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from store import channel
from store.pool import checksum

if TYPE_CHECKING:
    from messenger.api import PeerInfo
    from store.service import PoolService

log = logging.getLogger(__name__)

ARENA_REGION = "kv-pool-arena"
INLINE_BYTES = 1 << 20


class RemotePool:
    def __init__(self, service: "PoolService", engine_config=None):
        from dataclasses import replace

        from messenger.engine import EngineConfig, TransferEngine

        self._service = service
        config = engine_config or replace(EngineConfig(), checksums=False)
        self.engine = TransferEngine(f"kv-pool-{socket.gethostname()}-{os.getpid()}", config)
        self.engine.register(ARENA_REGION, service.arena.array)
        self._info = self.engine.start(on_call=self._on_call)
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[list[int], float]] = {}
        self._next_lease = 1
        self._peers: set[str] = set()
        self._unpinner = ThreadPoolExecutor(1, thread_name_prefix="pool-unpin")

    def info(self) -> "PeerInfo":
        return self._info

    def close(self) -> None:
        self._unpinner.shutdown(wait=False)
        self.engine.close()

    # --- fetching from a peer --------------------------------------------------------------
    def fetch(self, peer: "PeerInfo", keys: Sequence[int]) -> int:
        service = self._service
        held = len(service.lookup(keys))
        want = list(keys[held:])
        if not want:
            return held
        if peer.name not in self._peers:
            self.engine.add_peer(peer)
            self._peers.add(peer.name)
        if len(want) * service.config.block_bytes <= INLINE_BYTES:
            self._fetch_inline(peer.name, want)
        else:
            self._fetch_by_read(peer.name, want)
        return len(service.lookup(keys))

    def _fetch_inline(self, peer: str, keys: list[int]) -> None:
        reply = channel.decode(self.engine.call(peer, channel.encode({"op": "get", "keys": channel.pack_keys(keys)})))
        got = channel.unpack_keys(reply["keys"])
        bb = self._service.config.block_bytes
        data = memoryview(reply["data"])
        digests = dict(zip(got, reply["checksums"]))
        offsets = {k: i * bb for i, k in enumerate(got)}
        slots = self._service.reserve(got)
        for key, slot in slots:
            self._service.arena.slot(slot)[:] = data[offsets[key]:offsets[key] + bb]
        self._commit_verified(slots, digests)

    def _fetch_by_read(self, peer: str, keys: list[int]) -> None:
        from messenger.api import Slice

        reply = channel.decode(self.engine.call(peer, channel.encode({"op": "pin", "keys": channel.pack_keys(keys)})))
        lease = reply["lease"]
        try:
            got = channel.unpack_keys(reply["keys"])
            remote = dict(zip(got, reply["slots"]))
            digests = dict(zip(got, reply["checksums"]))
            slots = self._service.reserve(got)
            bb = self._service.config.block_bytes
            slices: list[Slice] = []
            for key, slot in slots:  # coalesce runs adjacent on both sides into one slice
                last = slices[-1] if slices else None
                if (last is not None and last.local_offset + last.length == slot * bb
                        and last.remote_offset + last.length == remote[key] * bb):
                    slices[-1] = Slice(ARENA_REGION, last.local_offset, ARENA_REGION, last.remote_offset,
                                       last.length + bb)
                else:
                    slices.append(Slice(ARENA_REGION, slot * bb, ARENA_REGION, remote[key] * bb, bb))
            if slices:
                try:
                    self.engine.read(peer, slices).wait()
                except BaseException:
                    self._service.abort([k for k, _ in slots])
                    raise
            self._commit_verified(slots, digests)
        finally:
            self._unpinner.submit(self._unpin, peer, lease)

    def _unpin(self, peer: str, lease: int) -> None:
        try:
            self.engine.call(peer, channel.encode({"op": "unpin", "lease": lease}))
        except Exception as exc:  # noqa: BLE001 - the peer's lease runs out anyway
            log.debug("unpinning lease %d on %s failed: %s", lease, peer, exc)

    def _commit_verified(self, slots: list[tuple[int, int]], digests: dict[int, int]) -> None:
        good, bad = [], []
        for key, slot in slots:
            (good if checksum(self._service.arena.slot(slot)) == digests[key] else bad).append(key)
        if bad:
            self._service.counters["remote_corrupt"] += len(bad)
            log.warning("KV pool: %d blocks fetched from a peer failed their checksum; dropped", len(bad))
            self._service.abort(bad)
        self._service.commit(good, [digests[k] for k in good])
        self._service.counters["remote_fetched_blocks"] += len(good)

    # --- serving peers ---------------------------------------------------------------------
    def _on_call(self, peer: str, request: bytes) -> bytes:
        try:
            message = channel.decode(request)
            reply = {"ok": True, **self._answer(message)}
        except Exception as exc:  # noqa: BLE001 - the peer gets an answer, never a hang
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return channel.encode(reply)

    def _answer(self, message: dict) -> dict:
        service = self._service
        op = message.get("op")
        self._expire_leases()
        if op == "get":
            got = service.read(channel.unpack_keys(message["keys"]))
            try:
                data = b"".join(service.arena.slot(slot).tobytes() for _, slot, _ in got)
            finally:
                service.release([k for k, _, _ in got])
            service.counters["remote_served_blocks"] += len(got)
            return {"keys": channel.pack_keys([k for k, _, _ in got]), "checksums": [c for _, _, c in got],
                    "data": data}
        if op == "pin":
            got = service.read(channel.unpack_keys(message["keys"]))
            with self._lock:
                lease = self._next_lease
                self._next_lease += 1
                self._leases[lease] = ([k for k, _, _ in got], service._clock() + service.config.pin_lease_s)
            service.counters["remote_served_blocks"] += len(got)
            return {"keys": channel.pack_keys([k for k, _, _ in got]), "slots": [s for _, s, _ in got],
                    "checksums": [c for _, _, c in got], "lease": lease}
        if op == "unpin":
            with self._lock:
                keys, _ = self._leases.pop(int(message["lease"]), ([], 0.0))
            service.release(keys)
            return {}
        raise ValueError(f"unknown remote pool op {op!r}")

    def _expire_leases(self) -> None:
        now = self._service._clock()
        with self._lock:
            expired = [lease for lease, (_, until) in self._leases.items() if until <= now]
            keys = [k for lease in expired for k in self._leases.pop(lease)[0]]
        if keys:
            log.warning("KV pool: %d blocks pinned by a peer that never released them; unpinned", len(keys))
            self._service.release(keys)
