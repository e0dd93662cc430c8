"""Transport choice per peer and host identity (messenger/select.py)."""

from __future__ import annotations

import os

import pytest

from messenger.api import NoTransport, PeerInfo
from messenger.select import choose, host_id


class Fake:
    """A transport that reaches whoever `reach` says."""

    def __init__(self, name: str, reach: bool = True):
        self.name, self.reach = name, reach

    def can_reach(self, local: PeerInfo, peer: PeerInfo) -> bool:
        return self.reach


ALL = {"shm": "s", "rdma": "r", "nixl": "n", "tcp": "t"}


def info(name: str, host: str, transports=ALL) -> PeerInfo:
    return PeerInfo(name, host, {k: ALL[k] for k in transports})


def started(*names: str, unreachable: tuple[str, ...] = ()) -> list[Fake]:
    return [Fake(n, n not in unreachable) for n in names]


def pick(local, peer, transports) -> str:
    name = choose(local, peer, transports)
    assert name == choose(local, peer, {t.name: t for t in transports})  # the engine passes a dict
    return name


def test_same_host_takes_shm_whatever_the_configured_order():
    a, b = info("a", "h1"), info("b", "h1")
    assert pick(a, b, started("tcp", "nixl", "rdma", "shm")) == "shm"


def test_another_host_takes_rdma_when_both_publish_it():
    a, b = info("a", "h1"), info("b", "h2")
    assert pick(a, b, started("tcp", "nixl", "shm", "rdma")) == "rdma"
    assert pick(a, info("b", "h2", ("shm", "nixl", "tcp")), started("shm", "rdma", "nixl", "tcp")) == "nixl"
    assert pick(info("a", "h1", ("shm", "nixl", "tcp")), b, started("shm", "nixl", "tcp")) == "nixl"


def test_without_rdma_the_configured_order_ranks_nixl_and_tcp():
    a, b = info("a", "h1", ("nixl", "tcp")), info("b", "h2", ("nixl", "tcp"))
    assert pick(a, b, started("nixl", "tcp")) == "nixl"
    assert pick(a, b, started("tcp", "nixl")) == "tcp"
    assert pick(a, info("b", "h2", ("tcp",)), started("nixl", "tcp")) == "tcp"


def test_a_transport_that_cannot_reach_the_peer_is_passed_over():
    a, b = info("a", "h1"), info("b", "h1")
    assert pick(a, b, started("shm", "rdma", "tcp", unreachable=("shm",))) == "rdma"
    assert pick(a, info("b", "h2"), started("rdma", "nixl", "tcp", unreachable=("rdma",))) == "nixl"


def test_same_host_without_shm_on_the_peer_falls_to_the_next_rule():
    a, b = info("a", "h1"), info("b", "h1", ("tcp",))
    assert pick(a, b, started("shm", "rdma", "nixl", "tcp")) == "tcp"


def test_nothing_in_common_raises_and_says_why():
    a, b = info("a", "h1", ("rdma",)), info("b", "h2", ("shm", "tcp"))
    with pytest.raises(NoTransport) as caught:
        choose(a, b, started("shm", "rdma", "tcp"))
    text = str(caught.value)
    assert "shm: another host" in text and "rdma: not published by 'b'" in text
    assert "tcp: not published by this side" in text
    with pytest.raises(NoTransport, match="none started"):
        choose(a, b, [])


def test_host_id_is_the_boot_id_and_the_network_namespace(tmp_path):
    boot, machine = tmp_path / "boot_id", tmp_path / "machine-id"
    boot.write_text("b00t\n")
    machine.write_text("m4chine\n")
    ns = tmp_path / "ns"
    ns.write_text("")
    inode = os.stat(ns).st_ino
    assert host_id(str(boot), str(machine), str(ns)) == f"b00t/{inode}"
    assert host_id(str(tmp_path / "none"), str(machine), str(ns)) == f"m4chine/{inode}"
    other_ns = tmp_path / "ns2"
    other_ns.write_text("")
    assert host_id(str(boot), str(machine), str(other_ns)) != host_id(str(boot), str(machine), str(ns))
    with pytest.raises(RuntimeError, match="cannot identify"):
        host_id(str(tmp_path / "none"), str(tmp_path / "none"), str(ns))


def test_host_id_here_is_stable_and_differs_in_another_network_namespace():
    here = host_id()
    assert here == host_id() and here.split("/")[1] == str(os.stat("/proc/self/ns/net").st_ino)
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"):
        pytest.skip("needs root and unshare(1) to enter a new network namespace")
    import subprocess
    import sys

    out = subprocess.run(["/usr/bin/unshare", "--net", sys.executable, "-c",
                          "from messenger.select import host_id; print(host_id())"],
                         capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    if out.returncode != 0:
        pytest.skip(f"unshare --net is not permitted here: {out.stderr.strip()[-200:]}")
    there = out.stdout.strip()
    assert there.split("/")[0] == here.split("/")[0] and there != here
