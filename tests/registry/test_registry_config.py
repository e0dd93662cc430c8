"""RegistryConfig validation, open_registry's url schemes, the etcd fixture's failure text."""

import importlib.util
from pathlib import Path

import pytest

from mooncake.registry import MemoryRegistry, RegistryConfig, open_registry
from mooncake.registry.etcd import EtcdRegistry
from mooncake.registry.http import HttpRegistryClient


def test_open_registry_schemes() -> None:
    assert isinstance(open_registry("memory://"), MemoryRegistry)
    assert isinstance(open_registry("embedded+http://127.0.0.1:8000"), HttpRegistryClient)
    assert isinstance(open_registry("etcd://10.0.0.1:2379,10.0.0.2:2379"), EtcdRegistry)
    assert RegistryConfig("etcd://a:1,b:2").endpoints() == [("a", 1), ("b", 2)]


@pytest.mark.parametrize("url, match", [
    ("http://127.0.0.1:2379", "scheme must be one of"),  # ambiguous on purpose
    ("etcd://", "needs host:port"),
    ("etcd://host", "bad endpoint"),
    ("embedded+http://h:port", "bad endpoint"),
])
def test_bad_urls_are_refused(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RegistryConfig(url=url)


@pytest.mark.parametrize("kw, match", [
    (dict(ttl_s=0.5), "ttl_s"),
    (dict(ttl_s=2.0, keepalive_interval_s=1.5), "too short for a keepalive every 1.5 s"),
    (dict(retry_min_s=3.0, retry_max_s=1.0), "retry_min_s"),
    (dict(etcd_prefix="mooncake"), "etcd_prefix"),
])
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RegistryConfig(**kw)


def test_retrying_backs_off_exponentially_to_the_cap_and_only_on_unavailable(caplog) -> None:
    import asyncio
    import logging

    from mooncake.registry import RegistryUnavailable
    from mooncake.registry.retry import retrying

    delays: list[float] = []
    policy = retrying(0.1, 0.5, RegistryUnavailable)
    policy.sleep = lambda d: delays.append(d) or asyncio.sleep(0)  # no real waiting
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 6:
            raise RegistryUnavailable("down")
        return "up"

    with caplog.at_level(logging.WARNING, logger="mooncake.registry.retry"):
        assert asyncio.run(policy(flaky)) == "up"
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert len(caplog.records) == 5 and "0.4" in caplog.records[2].getMessage()

    async def broken() -> None:
        calls.append(1)
        raise KeyError("a bug, not an outage")

    calls.clear()
    with pytest.raises(KeyError):
        asyncio.run(retrying(0.1, 0.5, RegistryUnavailable)(broken))
    assert len(calls) == 1  # not retried
    with pytest.raises(ValueError, match="min_s"):
        retrying(1.0, 0.5, RegistryUnavailable)

    from mooncake.registry import RegistryRefused

    async def refused() -> None:
        calls.append(1)
        raise RegistryRefused("wrong password")

    calls.clear()
    with pytest.raises(RegistryRefused):  # no retry helps: it propagates at once
        asyncio.run(retrying(0.1, 0.5, RegistryUnavailable, final=RegistryRefused)(refused))
    assert len(calls) == 1


def test_missing_etcd_binary_says_how_to_install(monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location(
        "etcd_server_for_test", Path(__file__).parents[1] / "etcd_server.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    monkeypatch.setattr(m.shutil, "which", lambda _: None)
    monkeypatch.setattr(m.os, "access", lambda *_: False)
    with pytest.raises(RuntimeError, match="make test"):
        m.find_etcd()
