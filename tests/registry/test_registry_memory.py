"""MemoryRegistry: TTLs on an injected clock, watch semantics, in-process keepalive."""

import asyncio

import pytest

from mooncake.registry import InstanceInfo, MemoryRegistry, RegistryConfig


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def info(iid: str) -> InstanceInfo:
    return InstanceInfo(iid, "decode", "http://w", "127.0.0.1:1", "m", 16, 100, 0.0)


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_ttl_expiry_on_injected_clock() -> None:
    clock = FakeClock()
    reg = MemoryRegistry(clock=clock)
    reg.put(info("a"), ttl_s=5.0)
    reg.put(info("b"), ttl_s=5.0)
    clock.t = 4.0
    assert reg.heartbeat("a")
    clock.t = 8.9
    assert sorted(reg.list()) == ["a"]  # b was not refreshed: gone at 5.0
    clock.t = 9.1
    assert reg.list() == {}
    assert not reg.heartbeat("a")  # expired: the worker must register again


def test_watch_starts_with_resync_then_follows() -> None:
    async def main() -> None:
        clock = FakeClock()
        reg = MemoryRegistry(clock=clock, sweep_interval_s=0.01)
        reg.put(info("a"), ttl_s=1.0)
        it = reg.watch()
        first = await anext(it)
        assert first.kind == "resync" and list(first.snapshot) == ["a"]
        reg.put(info("b"), ttl_s=1.0)
        ev = await anext(it)
        assert (ev.kind, ev.instance_id, ev.info) == ("put", "b", info("b"))
        assert reg.heartbeat("b")
        ev = await anext(it)
        assert (ev.kind, ev.instance_id) == ("alive", "b")
        clock.t = 1.5  # nobody calls anything: the idle watcher's sweep must notice
        kinds = {(e.kind, e.instance_id) for e in [await anext(it), await anext(it)]}
        assert kinds == {("delete", "a"), ("delete", "b")}
        await it.aclose()
        assert not reg._subs  # the subscriber is gone with its iterator
    run(main())


def test_slow_watcher_gets_resync_instead_of_backlog() -> None:
    async def main() -> None:
        reg = MemoryRegistry(clock=FakeClock(), queue_limit=3)
        it = reg.watch()
        assert (await anext(it)).kind == "resync"
        for i in range(10):
            reg.put(info(f"i{i}"), ttl_s=1.0)
        ev = await anext(it)
        assert ev.kind == "resync" and len(ev.snapshot) == 10
        reg.remove("i0")
        ev = await anext(it)
        assert (ev.kind, ev.instance_id) == ("delete", "i0")
        await it.aclose()
    run(main())


def test_in_process_register_keepalive_and_reregister() -> None:
    async def main() -> None:
        clock = FakeClock()
        cfg = RegistryConfig(ttl_s=1.0, keepalive_interval_s=0.05)
        reg = MemoryRegistry(cfg, clock=clock)
        await reg.register(info("w"), ttl_s=1.0)
        clock.t = 100.0  # the process stalled past its TTL
        assert reg.list() == {}
        await asyncio.sleep(0.2)  # the keepalive notices (heartbeat False) and re-registers
        assert reg.list() == {"w": info("w")}
        await reg.deregister("w")
        assert reg.list() == {}
        await reg.close()
    run(main())


def test_an_in_process_keepalive_does_not_refresh_a_record_another_process_put() -> None:
    # A worker process put the same id over HTTP: the local keepalive leaves its record to
    # expire with it, then puts its own back (it used to keep the other's record alive).
    async def main() -> None:
        clock = FakeClock()
        reg = MemoryRegistry(RegistryConfig(ttl_s=1.0, keepalive_interval_s=0.05), clock=clock)
        mine = info("w")
        other = InstanceInfo("w", "decode", "http://elsewhere", "127.0.0.1:1", "m", 16, 100, 1.0)
        await reg.register(mine, ttl_s=1.0)
        reg.put(other, 1.0)
        await asyncio.sleep(0.2)
        assert reg.list() == {"w": other}
        clock.t = 0.9
        await asyncio.sleep(0.2)
        clock.t = 1.5  # past other's TTL: it was not refreshed
        await asyncio.sleep(0.2)
        assert reg.list() == {"w": mine}
        await reg.close()
    run(main())


def test_a_record_says_its_engines_chunk_and_an_older_one_without_it_still_decodes() -> None:
    from mooncake.registry.base import decode_info, encode_info

    info = InstanceInfo("d-1", "decode", "http://w", "127.0.0.1:1", "m", 16, 100, 0.0, chunk_tokens=128)
    assert decode_info(encode_info(info)).chunk_tokens == 128
    older = encode_info(info).replace(b',"chunk_tokens":128', b"")
    assert b"chunk_tokens" not in older and decode_info(older).chunk_tokens == 0  # 0: the conductor's own
    with pytest.raises(ValueError, match="chunk_tokens"):
        InstanceInfo("d-1", "decode", "http://w", "127.0.0.1:1", "m", 16, 100, 0.0, chunk_tokens=-1)
