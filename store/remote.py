"""Remote gets: nodes read blocks from each other's pools through the messenger.

The arena is a registered region of this node's TransferEngine. A fetch of k blocks from a
peer is one `call`:
- a peer on this host whose arena file this side can map (store/peer_arena.py): the call pins
  the blocks there and answers their slots; this side copies them out of the peer's arena,
  mapped read-only, and the pins go back with the next call;
- small (k x block_bytes up to INLINE_BYTES): the reply carries the bytes after a small
  header, sent from the peer's arena and received straight into slots reserved here (a call
  lane's attachment, messenger/call_lane.py): one round trip, no copy in Python;
- large: the fetcher reserves slots in its own arena and names them in the call; the peer
  pins the leading keys it holds (promoting SSD blocks), WRITES them straight into those slots
  (adjacent slots coalesced into one slice), unpins, and replies once the write landed: one
  call, whose handling includes the transfer, instead of a call to pin, a read and an unpin
  (measured on loopback tcp: 1.1-1.2 ms against 1.9-2.2 ms per batch of 16 x 64 KiB);
- when the peer cannot reach this node to write (no transport back): `pin` (a lease that
  expires, so a reader that died holds nothing for long), a one-sided `read` of the slots, and
  an `unpin` sent without waiting.
Every block is verified against the checksum the peer's index holds before it is committed
here; one that fails is dropped (counted), never served. Slots of a transfer that failed stay
reserved for twice the engine's timeout before reuse, so a peer that answers late cannot
overwrite a block stored there since. The messenger's own per-slice
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

import msgspec
import xxhash

from messenger.api import CallReply, PeerInfo, Slice, TransferError
from mooncake import defaults
from store import channel
from store.peer_arena import NotMappable, PeerArenas, PendingReleases, describe
from store.pool import checksum

if TYPE_CHECKING:
    from store.service import PoolService

log = logging.getLogger(__name__)

ARENA_REGION = "kv-pool-arena"


class NoWayBack(TransferError):
    """The peer cannot reach this node to write the blocks (no transport back)."""
# Up to this many bytes per call the blocks ride the reply (one round trip on one connection);
# beyond, the peer pushes them over the transport's parallel streams. Measured on loopback
# (2 cores): 16 x 64 KiB 14-18k blocks/s riding the reply against 9k pushed; one 4 MiB block
# 600/s against 330; 16 x 4 MiB 610/s against 730 (tcp) and 880 (shm).
INLINE_BYTES = 4 << 20


class RemotePool:
    def __init__(self, service: "PoolService", engine_config=None):
        from dataclasses import replace

        from messenger.engine import EngineConfig, TransferEngine

        self._service = service
        # What the blocks here are (the engine's KV layout and block bytes): a peer's must match,
        # or its blocks would be copied into slots that mean something else (foreign KV).
        self.layout_id = xxhash.xxh3_64_intdigest(f"{service.config.block_bytes}|{service.layout}".encode())
        # The KV path's transports unless told otherwise: NIXL's agent polls a core (defaults.py).
        config = engine_config or replace(EngineConfig(), checksums=False, transports=defaults.KV_TRANSPORTS)
        self.engine = TransferEngine(f"kv-pool-{socket.gethostname()}-{os.getpid()}", config)
        self.engine.register(ARENA_REGION, service.arena.array)
        try:
            self._info = self.engine.start(on_call=self._on_call)
        except BaseException:  # the transports it did start, and its hold on the arena, go with it
            self._release_engine()
            raise
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[list[int], float]] = {}
        self._next_lease = 1
        self._peers: dict[str, str] = {}  # peer name -> the transport the engine chose for it
        self._introduced: set[str] = set()  # peers that have our PeerInfo (they push to us)
        self._known: set[str] = set()  # peers whose PeerInfo we have (we push to them)
        self._unpinner = ThreadPoolExecutor(1, thread_name_prefix="pool-unpin")
        self._peer_arenas = PeerArenas()
        self._releases = PendingReleases(lambda peer, leases: self._unpinner.submit(self._unpin, peer, leases))

    def info(self) -> "PeerInfo":
        return self._info

    def close(self) -> None:
        for peer, leases in self._releases.close().items():  # best effort: they expire there anyway
            self._unpinner.submit(self._unpin, peer, leases)
        self._unpinner.shutdown(wait=False)
        self._release_engine()
        self._peer_arenas.close()

    def _release_engine(self) -> None:
        # The engine's region table holds a view of the arena: while it lives, the arena's map
        # cannot close, and its shared-memory pages stay taken after the pool is gone.
        self.engine.unregister(ARENA_REGION)
        self.engine.close()

    # --- fetching from a peer --------------------------------------------------------------
    def fetch(self, peer: "PeerInfo", keys: Sequence[int]) -> int:
        """Bring the leading run of `keys` the peer holds; returns how many leading keys this
        node holds after. One call moves at most what the peer can pin at once (a long prefix
        mostly on its SSD), so it calls again while that makes progress; not once this pool ran
        out of room (the next call would evict the blocks the last one brought)."""
        service = self._service
        held = len(service.lookup(keys))
        if held == len(keys):
            return held
        if peer.name not in self._peers:
            self._peers[peer.name] = self.engine.add_peer(peer)
        same_host = service.config.map_same_host_peers and peer.host_id == self._info.host_id
        while held < len(keys):
            want = list(keys[held:])
            room = None
            if same_host and not self._peer_arenas.refused(peer.name):
                room = self._fetch_mapped(peer.name, want)
            if room is None:
                if len(want) * service.config.block_bytes <= INLINE_BYTES:
                    room = self._fetch_inline(peer.name, want)
                else:
                    try:
                        room = self._fetch_by_push(peer.name, want)
                    except NoWayBack:
                        room = self._fetch_by_read(peer.name, want)
            now = len(service.lookup(keys))
            progress, held = now > held, now
            if not (progress and room):
                break
        return held

    def _call(self, peer: str, message: dict, **kwargs):
        return self.engine.call(peer, channel.encode({**message, "layout": self.layout_id}), **kwargs)

    def _fetch_by_push(self, peer: str, keys: list[int]) -> bool:
        """True when this pool had room for all of `keys`."""
        slots = self._service.reserve(keys)
        if not slots:
            return False
        request = {"op": "push", "keys": channel.pack_keys([k for k, _ in slots]), "slots": [s for _, s in slots]}
        if peer not in self._introduced:  # the peer needs our PeerInfo to write to us
            request["who"] = msgspec.json.encode(self._info)
        try:
            reply = channel.decode(self._call(peer, request))
            if not reply["ok"] and "unknown peer" in reply.get("error", "") and "who" not in request:
                self._introduced.discard(peer)  # it restarted and forgot us
                request["who"] = msgspec.json.encode(self._info)
                reply = channel.decode(self._call(peer, request))
        except BaseException:
            self._quarantine([k for k, _ in slots])
            raise
        if not reply["ok"]:
            self._quarantine([k for k, _ in slots])
            if "NoTransport" in reply["error"]:
                raise NoWayBack(reply["error"])
            raise TransferError(f"{peer} refused to send blocks: {reply['error']}")
        self._introduced.add(peer)
        got = channel.unpack_keys(reply["keys"])
        digests = dict(zip(got, reply["checksums"]))
        self._service.abort([k for k, _ in slots if k not in digests])
        self._commit_verified([(k, s) for k, s in slots if k in digests], digests)
        return len(slots) == len(keys)

    def _fetch_inline(self, peer: str, keys: list[int]) -> bool:
        """One call; the peer's blocks land straight in slots reserved here once its header
        said which keys it holds (a key this pool has no room for lands in scratch and is
        dropped). True when there was room for all."""
        service, bb = self._service, self._service.config.block_bytes
        landed: dict = {}

        def into(body: bytes, nbytes: int) -> list:
            head = _checked(peer, body)
            got = channel.unpack_keys(head["keys"])
            if nbytes != len(got) * bb:
                raise TransferError(f"{peer} sent {nbytes} B for {len(got)} blocks of {bb} B")
            landed["slots"] = slots = dict(service.reserve(got))
            landed["digests"] = dict(zip(got, head["checksums"]))
            scratch = memoryview(bytearray(bb)) if len(slots) < len(got) else None
            return [service.arena.slot(slots[k]) if k in slots else scratch for k in got]

        try:
            reply = self._call(peer, {"op": "get", "keys": channel.pack_keys(keys)}, into=into)
        except BaseException:
            if landed:  # the lane that carried them is closed: nothing writes these slots any more
                service.abort(list(landed["slots"]))
            raise
        if not landed:  # nothing held there, or an error
            _checked(peer, reply)
            return True
        self._commit_verified(list(landed["slots"].items()), landed["digests"])
        return len(landed["slots"]) == len(landed["digests"])

    def _fetch_by_read(self, peer: str, keys: list[int]) -> bool:
        """True when this pool had room for all the peer holds of `keys`."""
        reply = _checked(peer, self._call(peer, {"op": "pin", "keys": channel.pack_keys(keys)}))
        lease = reply["lease"]
        try:
            got = channel.unpack_keys(reply["keys"])
            remote = dict(zip(got, reply["slots"]))
            digests = dict(zip(got, reply["checksums"]))
            slots = self._service.reserve(got)
            slices = coalesce([(slot, remote[key]) for key, slot in slots], self._service.config.block_bytes)
            if slices:
                try:
                    self.engine.read(peer, slices).wait()
                except BaseException:
                    self._quarantine([k for k, _ in slots])
                    raise
            self._commit_verified(slots, digests)
            return len(slots) == len(got)
        finally:
            self._unpinner.submit(self._unpin, peer, [lease])

    def _fetch_mapped(self, peer: str, keys: list[int]) -> bool | None:
        """A same-host peer's blocks copied out of its arena (store/peer_arena.py) after one
        call that pins them; None when its arena cannot be mapped from here (nothing fetched)."""
        request = {"op": "pin", "keys": channel.pack_keys(keys), "arena": True}
        done = self._releases.take(peer)
        if done:
            request["unpin"] = done
        try:
            reply = _checked(peer, self._call(peer, request))
        except BaseException:
            for lease in done:  # not delivered: they go with the next call, or on their own
                self._releases.add(peer, lease)
            raise
        try:
            if "arena" not in reply:
                raise NotMappable("the peer does not describe its arena")
            theirs = self._peer_arenas.get(peer, reply["arena"])
        except NotMappable:
            self._releases.add(peer, reply["lease"])
            return None
        slots: list[tuple[int, int]] = []
        try:
            got = channel.unpack_keys(reply["keys"])
            remote = dict(zip(got, reply["slots"]))
            slots = self._service.reserve(got)
            for key, slot in slots:
                self._service.arena.slot(slot)[:] = theirs.slot(remote[key])
        except BaseException:
            self._service.abort([k for k, _ in slots])
            raise
        finally:
            self._releases.add(peer, reply["lease"])
        self._commit_verified(slots, dict(zip(got, reply["checksums"])))
        return len(slots) == len(got)

    def _quarantine(self, keys: list[int]) -> None:
        """Slots a failed transfer may still write into (a peer that answers late) stay reserved,
        so never read nor handed to another block, for twice the engine's timeout, then go back."""
        if keys:
            timer = threading.Timer(2 * self.engine.config.timeout_s, self._service.abort, [keys])
            timer.daemon = True
            timer.start()

    def _unpin(self, peer: str, leases: list[int]) -> None:
        try:
            self.engine.call(peer, channel.encode({"op": "unpin", "leases": leases}))
        except Exception as exc:  # noqa: BLE001 - the peer's lease runs out anyway
            log.debug("unpinning leases %s on %s failed: %s", leases, peer, exc)

    def _commit_verified(self, slots: list[tuple[int, int]], digests: dict[int, int]) -> None:
        good, bad = [], []
        for key, slot in slots:
            (good if checksum(self._service.arena.slot(slot)) == digests[key] else bad).append(key)
        if bad:
            self._service.count("remote_corrupt", len(bad))
            log.warning("KV pool: %d blocks fetched from a peer failed their checksum; dropped", len(bad))
            self._service.abort(bad)
        self._service.commit(good, [digests[k] for k in good])
        self._service.count("remote_fetched_blocks", len(good))

    # --- serving peers ---------------------------------------------------------------------
    def _on_call(self, peer: str, request: bytes) -> bytes | CallReply:
        try:
            message = channel.decode(request)
            self.expire_leases()
            if message.get("op") in ("get", "pin", "push") and message.get("layout") != self.layout_id:
                raise ValueError("the peer's KV layout (model, dtype, block size) differs from this pool's")
            if message.get("op") == "get":
                return self._get_inline(channel.unpack_keys(message["keys"]))
            reply = {"ok": True, **self._answer(peer, message)}
        except Exception as exc:  # noqa: BLE001 - the peer gets an answer, never a hang
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return channel.encode(reply)

    def _get_inline(self, keys: list[int]) -> CallReply:
        """The blocks held, sent from the arena after a small header, pinned until sent."""
        service = self._service
        got = service.read(keys)
        try:
            head = channel.encode({"ok": True, "keys": channel.pack_keys([k for k, _, _ in got]),
                                   "checksums": [c for _, _, c in got]})
            views = [service.arena.slot(slot) for _, slot, _ in got]
        except BaseException:
            service.release([k for k, _, _ in got])
            raise
        service.count("remote_served_blocks", len(got))
        return CallReply(head, views, lambda: service.release([k for k, _, _ in got]))

    def _answer(self, peer: str, message: dict) -> dict:
        service = self._service
        op = message.get("op")
        if op == "push":
            if "who" in message:
                self.engine.add_peer(msgspec.json.decode(message["who"], type=PeerInfo))
                with self._lock:
                    self._known.add(peer)
            elif peer not in self._known:
                raise LookupError(f"unknown peer {peer!r}: send 'who' first")
            got = service.read(channel.unpack_keys(message["keys"]))
            try:
                if got:
                    dest = dict(zip(channel.unpack_keys(message["keys"]), message["slots"]))
                    slices = coalesce([(slot, dest[key]) for key, slot, _ in got], service.config.block_bytes)
                    self.engine.write(peer, slices).wait()
            finally:
                service.release([k for k, _, _ in got])
            service.count("remote_served_blocks", len(got))
            return {"keys": channel.pack_keys([k for k, _, _ in got]), "checksums": [c for _, _, c in got]}
        if op == "pin":
            self._release_leases(message.get("unpin", ()))  # a same-host reader's previous pins
            got = service.read(channel.unpack_keys(message["keys"]))
            with self._lock:
                lease = self._next_lease
                self._next_lease += 1
                self._leases[lease] = ([k for k, _, _ in got], service._clock() + service.config.pin_lease_s)
            service.count("remote_served_blocks", len(got))
            reply = {"keys": channel.pack_keys([k for k, _, _ in got]), "slots": [s for _, s, _ in got],
                     "checksums": [c for _, _, c in got], "lease": lease}
            if message.get("arena"):
                reply["arena"] = describe(service.arena)
            return reply
        if op == "unpin":
            self._release_leases(message["leases"])
            return {}
        raise ValueError(f"unknown remote pool op {op!r}")

    def _release_leases(self, leases) -> None:
        with self._lock:
            keys = [k for lease in leases for k in self._leases.pop(int(lease), ([], 0.0))[0]]
        self._service.release(keys)

    def expire_leases(self) -> None:
        """Unpin what peers pinned and never released within the lease (called on every peer call
        and every local reserve, so a dead peer's pins go even when only gets or saves follow)."""
        now = self._service._clock()
        with self._lock:
            expired = [lease for lease, (_, until) in self._leases.items() if until <= now]
            keys = [k for lease in expired for k in self._leases.pop(lease)[0]]
        if keys:
            log.warning("KV pool: %d blocks pinned by a peer that never released them; unpinned", len(keys))
            self._service.release(keys)


def coalesce(pairs: list[tuple[int, int]], block_bytes: int) -> list[Slice]:
    """Slices for (local slot, remote slot) pairs, runs adjacent on both sides merged into one."""
    slices: list[Slice] = []
    for local, remote in pairs:
        last = slices[-1] if slices else None
        if (last is not None and last.local_offset + last.length == local * block_bytes
                and last.remote_offset + last.length == remote * block_bytes):
            slices[-1] = Slice(ARENA_REGION, last.local_offset, ARENA_REGION, last.remote_offset,
                               last.length + block_bytes)
        else:
            slices.append(Slice(ARENA_REGION, local * block_bytes, ARENA_REGION, remote * block_bytes, block_bytes))
    return slices


def _checked(peer: str, reply_bytes: bytes) -> dict:
    reply = channel.decode(reply_bytes)
    if not reply.get("ok"):
        raise TransferError(f"{peer} refused: {reply.get('error')}")
    return reply
