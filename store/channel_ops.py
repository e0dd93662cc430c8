"""The local channel's ops on the service side: each request (store/channel.py lists them) as
the PoolService call it names, and its reply. Pure dispatch: the service's state stays its own."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from store import channel

if TYPE_CHECKING:
    from store.service import PoolService


def answer(service: "PoolService", request: dict[str, Any], pins: Counter[int]) -> dict[str, Any]:
    """The reply to one request of a connection; `pins` are what that connection holds pinned
    (read adds to them, release takes only from them)."""
    op = request.get("op")
    keys = channel.unpack_keys(request["keys"]) if "keys" in request else []
    if op == "lookup":
        return {"tiers": service.lookup(keys)}
    if op == "reserve":
        slots = service.reserve(keys)
        return {"keys": channel.pack_keys([k for k, _ in slots]), "slots": [s for _, s in slots]}
    if op == "commit":
        return {"committed": service.commit(keys, request.get("checksums"))}
    if op == "abort":
        service.abort(keys)
        return {}
    if op == "read":
        got = service.read(keys)
        pins.update(k for k, _, _ in got)
        return {"keys": channel.pack_keys([k for k, _, _ in got]), "slots": [s for _, s, _ in got],
                "checksums": [c for _, _, c in got]}
    if op == "release":
        # Only what this connection holds, counted as it goes: a key named twice must not
        # take another reader's pin (its block could then be evicted mid-copy).
        held = []
        for k in keys:
            if pins[k] > 0:
                pins[k] -= 1
                held.append(k)
            if not pins[k]:  # a Counter keeps zero counts: every key ever read, for the engine's life
                del pins[k]
        service.release(held)
        return {}
    if op == "discard":
        service.discard(keys)
        return {}
    if op == "fetch_remote":
        import msgspec

        from messenger.api import PeerInfo

        peer = msgspec.json.decode(request["peer"], type=PeerInfo)
        return {"fetched": service.fetch_remote(peer, keys)}
    if op == "configure":
        info = service.configure(int(request["block_bytes"]), str(request["layout"]))
        return {"arena": {"path": info.path, "block_bytes": info.block_bytes, "slots": info.slots}}
    if op == "stats":
        return service.stats()
    if op == "events":
        page = service.events_since(int(request.get("since", -1)))
        return {"seq": page.seq, "reset": page.reset,
                "events": [[kind, key.to_bytes(16, "big"), tier] for kind, key, tier in page.events]}
    raise ValueError(f"unknown pool op {op!r}")
