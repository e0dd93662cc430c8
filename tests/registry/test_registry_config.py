"""RegistryConfig validation, open_registry's url schemes, the etcd fixture's failure text."""

import importlib.util
from pathlib import Path

import pytest

from mooncake.registry import MemoryRegistry, RegistryConfig, open_registry
from mooncake.registry.config import Backoff
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
    (dict(ttl_s=2.0, keepalive_interval_s=1.5), "keepalive_interval_s"),
    (dict(load_interval_s=0), "load_interval_s"),
    (dict(retry_min_s=3.0, retry_max_s=1.0), "retry_min_s"),
    (dict(etcd_prefix="mooncake"), "etcd_prefix"),
])
def test_bad_settings_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RegistryConfig(**kw)


def test_backoff_doubles_to_max_and_resets() -> None:
    b = Backoff(0.1, 0.5)
    assert [b.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.next() == 0.1


def test_missing_etcd_binary_says_how_to_install(monkeypatch) -> None:
    spec = importlib.util.spec_from_file_location(
        "etcd_server_for_test", Path(__file__).parents[1] / "etcd_server.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    monkeypatch.setattr(m.shutil, "which", lambda _: None)
    monkeypatch.setattr(m.os, "access", lambda *_: False)
    with pytest.raises(RuntimeError, match="make test"):
        m.find_etcd()
