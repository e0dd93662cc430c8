"""ClusterView: events in, view out, with an explicit clock."""

import pytest

from mooncake.registry import (ClusterView, InstanceInfo, InstanceLoad, RegistryEvent,
                               ViewConfig, decode_info, decode_load, encode_info, encode_load)


def info(iid: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(iid, role, f"http://127.0.0.1:9000/{iid}", "127.0.0.1:7000", "m", 16,
                        1000, 1.0)


def put(iid: str, role: str = "prefill") -> RegistryEvent:
    return RegistryEvent("put", iid, info=info(iid, role))


def load(iid: str, queued: int) -> RegistryEvent:
    return RegistryEvent("load", iid, load=InstanceLoad(iid, queued_prefill_tokens=queued))


def test_events_build_the_view() -> None:
    v = ClusterView()
    v.apply(put("p0"), now=0.0)
    v.apply(put("d0", "decode"), now=0.0)
    v.apply(put("b0", "both"), now=0.0)
    v.apply(load("p0", 512), now=0.5)
    assert [i.instance_id for i in v.instances()] == ["b0", "d0", "p0"]
    assert [i.instance_id for i in v.instances(role="prefill")] == ["b0", "p0"]
    assert [i.instance_id for i in v.instances(role="decode")] == ["b0", "d0"]
    assert v.load("p0").queued_prefill_tokens == 512
    v.apply(RegistryEvent("delete", "d0"), now=1.0)
    assert "d0" not in v and len(v) == 2


def test_reregistration_keeps_last_load_and_unknown_load_is_ignored() -> None:
    v = ClusterView()
    v.apply(put("p0"), now=0.0)
    v.apply(load("p0", 7), now=0.0)
    v.apply(put("p0"), now=1.0)
    assert v.load("p0").queued_prefill_tokens == 7
    v.apply(load("ghost", 3), now=1.0)
    assert "ghost" not in v


def test_ttl_expiry_with_explicit_clock() -> None:
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(put("p0"), now=0.0)
    v.apply(put("p1"), now=0.0)
    v.apply(load("p1", 0), now=4.0)  # p1 refreshes, p0 stays silent
    assert [i.instance_id for i in v.alive(now=5.0)] == ["p0", "p1"]
    assert [i.instance_id for i in v.alive(now=5.5)] == ["p1"]
    assert len(v) == 2  # alive() does not mutate
    assert v.expire(now=5.5) == ["p0"]
    assert [i.instance_id for i in v.instances()] == ["p1"]
    assert v.expire(now=9.5) == ["p1"]


def test_resync_replaces_the_view() -> None:
    v = ClusterView()
    assert not v.synced
    v.apply(put("old"), now=0.0)
    snap = {"a": (info("a"), None), "b": (info("b", "decode"), InstanceLoad("b", 1, 2, 3, 4))}
    v.apply(RegistryEvent("resync", snapshot=snap), now=1.0)
    assert v.synced
    assert [i.instance_id for i in v.instances()] == ["a", "b"]
    assert v.load("b").waiting_requests == 3 and v.load("a") is None


def test_last_view_kept_during_outage_then_resync() -> None:
    v = ClusterView(ViewConfig(expire_after_s=5.0))
    v.apply(RegistryEvent("resync", snapshot={"p0": (info("p0"), None)}), now=0.0)
    v.apply(RegistryEvent("outage"), now=1.0)
    v.apply(RegistryEvent("outage"), now=2.0)  # repeated: the first one counts
    assert v.outage_since == 1.0
    # Long silence during an outage says nothing about the workers: keep serving.
    assert [i.instance_id for i in v.alive(now=100.0)] == ["p0"]
    assert v.expire(now=100.0) == []
    v.apply(RegistryEvent("resync", snapshot={"p1": (info("p1"), None)}), now=101.0)
    assert v.outage_since is None
    assert [i.instance_id for i in v.alive(now=101.0)] == ["p1"]
    assert v.expire(now=107.0) == ["p1"]  # TTL is back in force after the resync


def test_codec_round_trip_and_versioning() -> None:
    i = info("p0", "both")
    assert decode_info(encode_info(i)) == i
    ld = InstanceLoad("p0", 1, 2, 3, 4, 5.5)
    assert decode_load(encode_load(ld)) == ld
    # Forward compatible: unknown fields ignored, missing counters default to 0.
    assert decode_load(b'{"v":1,"instance_id":"p0","new_field":9}') == InstanceLoad("p0")
    with pytest.raises(ValueError, match="wire version"):
        decode_info(b'{"v":2,"instance_id":"p0"}')
    with pytest.raises(ValueError, match="missing field"):
        decode_info(b'{"v":1,"instance_id":"p0"}')
    with pytest.raises(ValueError, match="role"):
        InstanceInfo("x", "router", "u", "a:1", "m", 16, 1, 0.0)  # type: ignore[arg-type]
