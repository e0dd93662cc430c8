"""ClusterView: events in, view out, with an explicit clock."""

import json

import pytest

import msgspec

from mooncake.registry import (ClusterView, InstanceInfo, RegistryEvent, ViewConfig, decode_info,
                               encode_info)


def info(iid: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(iid, role, f"http://127.0.0.1:9000/{iid}", "127.0.0.1:7000", "m", 16,
                        1000, 1.0)


def put(iid: str, role: str = "prefill") -> RegistryEvent:
    return RegistryEvent("put", iid, info=info(iid, role))


def alive(iid: str) -> RegistryEvent:
    return RegistryEvent("alive", iid)


def test_events_build_the_view() -> None:
    v = ClusterView()
    v.apply(put("p0"), now=0.0)
    v.apply(put("d0", "decode"), now=0.0)
    v.apply(put("b0", "both"), now=0.0)
    v.apply(alive("p0"), now=0.5)
    assert [i.instance_id for i in v.instances()] == ["b0", "d0", "p0"]
    assert [i.instance_id for i in v.instances(role="prefill")] == ["b0", "p0"]
    assert [i.instance_id for i in v.instances(role="decode")] == ["b0", "d0"]
    assert v.last_seen("p0") == 0.5 and v.last_seen("d0") == 0.0
    v.apply(RegistryEvent("delete", "d0"), now=1.0)
    assert "d0" not in v and len(v) == 2


def test_reregistration_replaces_info_and_unknown_alive_is_ignored() -> None:
    v = ClusterView()
    v.apply(put("p0"), now=0.0)
    v.apply(put("p0", "both"), now=1.0)
    assert v.get("p0").role == "both" and v.last_seen("p0") == 1.0
    v.apply(alive("ghost"), now=1.0)
    assert "ghost" not in v and v.get("ghost") is None


def test_ttl_expiry_with_explicit_clock() -> None:
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(put("p0"), now=0.0)
    v.apply(put("p1"), now=0.0)
    v.apply(alive("p1"), now=4.0)  # p1 refreshes, p0 stays silent
    assert [i.instance_id for i in v.alive(now=5.0)] == ["p0", "p1"]
    assert [i.instance_id for i in v.alive(now=5.5)] == ["p1"]
    assert len(v) == 2  # alive() does not mutate
    assert v.expire(now=5.5) == ["p0"]
    assert [i.instance_id for i in v.instances()] == ["p1"]
    v.apply(put("p2"), now=9.0)  # the registry still speaks: p1's silence is its own
    assert v.expire(now=9.5) == ["p1"]


def test_resync_replaces_the_view() -> None:
    v = ClusterView()
    assert not v.synced
    v.apply(put("old"), now=0.0)
    snap = {"a": info("a"), "b": info("b", "decode")}
    v.apply(RegistryEvent("resync", snapshot=snap), now=1.0)
    assert v.synced
    assert [i.instance_id for i in v.instances()] == ["a", "b"]
    assert v.get("b") == info("b", "decode") and v.last_seen("a") == 1.0


def test_last_view_kept_during_outage_then_resync() -> None:
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(RegistryEvent("resync", snapshot={"p0": info("p0")}), now=0.0)
    v.apply(RegistryEvent("outage"), now=1.0)
    v.apply(RegistryEvent("outage"), now=2.0)  # repeated: the first one counts
    assert v.outage_since == 1.0
    # Long silence during an outage says nothing about the workers: keep serving.
    assert [i.instance_id for i in v.alive(now=100.0)] == ["p0"]
    assert v.expire(now=100.0) == []
    v.apply(RegistryEvent("resync", snapshot={"p1": info("p1")}), now=101.0)
    assert v.outage_since is None
    assert [i.instance_id for i in v.alive(now=101.0)] == ["p1"]
    v.apply(put("p2"), now=106.0)
    assert v.expire(now=107.0) == ["p1"]  # TTL is back in force after the resync


def test_a_registry_silent_as_a_whole_expires_nobody() -> None:
    # A frozen etcd, or a half-open connection, need not end the watch with an outage; nor does
    # a conductor whose event loop stalled hear anything. Every worker dying at once is not the
    # likely cause: the view is kept (the health polls still stop routing to a dead one).
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(RegistryEvent("resync", snapshot={"p0": info("p0"), "p1": info("p1")}), now=0.0)
    assert v.expire(now=60.0) == [] and [i.instance_id for i in v.alive(now=60.0)] == ["p0", "p1"]
    v.apply(alive("p1"), now=61.0)  # it speaks again: p0's silence is its own now
    assert v.expire(now=61.0) == ["p0"]


def test_a_backend_that_freezes_between_staggered_refreshes_drops_nobody() -> None:
    # Instances refresh at their own times within a keepalive interval. When the backend froze,
    # each instance's silence began before the backend's: all but the last one heard from crossed
    # expire_after_s while the backend had been silent for less, and were dropped (with a real
    # etcd stopped by SIGSTOP, the conductor kept 1 worker of 4).
    v = ClusterView(ViewConfig(expire_after_s=8.0))
    ids = ["p0", "p1", "p2", "p3"]
    v.apply(RegistryEvent("resync", snapshot={i: info(i) for i in ids}), now=0.0)
    t = 0.0
    for second in range(1, 6):  # a keepalive each second, 0.25 s apart
        for k, iid in enumerate(ids):
            t = second + 0.25 * k
            v.apply(alive(iid), now=t)
    assert t == 5.75  # the backend freezes after p3's refresh
    now = t
    while now < t + 60:  # the conductor's expire loop runs every 0.5 s
        now += 0.1
        assert v.expire(now) == [], now
        assert [i.instance_id for i in v.alive(now)] == ids
    # It speaks again (p3 alone: the others' leases lapsed meanwhile): the others' silence is theirs.
    v.apply(alive("p3"), now=now)
    assert v.expire(now) == ["p0", "p1", "p2"]


def test_an_instance_dropped_by_the_view_comes_back_with_its_next_alive() -> None:
    # The backend sends a put only when an instance (re)registers: a live instance dropped by
    # the view's own net used to stay unroutable while its lease lived.
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(put("p0", "decode"), now=0.0)
    v.apply(put("p1"), now=0.0)
    v.apply(alive("p1"), now=5.0)
    assert v.expire(now=6.0) == ["p0"] and "p0" not in v
    v.apply(alive("p0"), now=7.0)
    assert v.get("p0") == info("p0", "decode") and v.last_seen("p0") == 7.0
    # A delete (the lease ended) or a resync forgets it for good.
    v.apply(alive("p1"), now=12.5)
    assert v.expire(now=13.0) == ["p0"]
    v.apply(RegistryEvent("delete", "p0"), now=13.5)
    v.apply(alive("p0"), now=14.0)
    assert "p0" not in v


def test_codec_round_trip_and_versioning() -> None:
    i = info("p0", "both")
    assert decode_info(encode_info(i)) == i
    # The stored shape is the hand-written codec's (version first, then the fields), plus the
    # engine's chunk size, which older records lack (they decode with 0, "not said").
    assert json.loads(encode_info(i)) == {
        "v": 1, "instance_id": "p0", "role": "both", "http_url": "http://127.0.0.1:9000/p0",
        "kv_address": "127.0.0.1:7000", "model": "m", "block_size": 16,
        "kv_capacity_tokens": 1000, "started_at": 1.0, "chunk_tokens": 0}
    assert list(json.loads(encode_info(i)))[0] == "v"
    # Forward compatible: a newer writer's extra fields are ignored.
    extra = json.dumps({**json.loads(encode_info(i)), "new_field": 9}, separators=(",", ":"))
    assert decode_info(extra) == i
    with pytest.raises(ValueError, match=r"\$\.v"):  # another wire version
        decode_info(b'{"v":2,"instance_id":"p0"}')
    with pytest.raises(msgspec.ValidationError, match="missing required field `role`"):
        decode_info(b'{"v":1,"instance_id":"p0"}')
    with pytest.raises(ValueError, match=r"\$\.block_size"):
        decode_info(extra.replace('"block_size":16', '"block_size":"16"'))
    with pytest.raises(ValueError, match="block_size must be > 0"):  # __post_init__ on decode
        decode_info(extra.replace('"block_size":16', '"block_size":0'))
    with pytest.raises(ValueError, match=r"\$\.role"):
        decode_info(extra.replace('"both"', '"router"'))
    with pytest.raises(ValueError, match="role"):
        InstanceInfo("x", "router", "u", "a:1", "m", 16, 1, 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="instance_id"):
        InstanceInfo("a/b", "decode", "u", "a:1", "m", 16, 1, 0.0)
