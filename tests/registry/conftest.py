"""Fixtures of the registry tests: a real etcd per test (about half a second to start)."""

import importlib.util
from pathlib import Path

import pytest

# tests/ is not a package (test dirs are rootdir-relative), so load the shared helper by path.
_spec = importlib.util.spec_from_file_location(
    "mooncake_tests_etcd_server", Path(__file__).parents[1] / "etcd_server.py")
etcd_server_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(etcd_server_mod)


@pytest.fixture
def etcd_server(tmp_path):
    """A running single-node etcd; FAILS (does not skip) when etcd is not installed."""
    try:
        server = etcd_server_mod.EtcdServer(tmp_path)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        server.start()  # inside the try: a start that times out must not leak the process
        yield server
    finally:
        server.kill()
