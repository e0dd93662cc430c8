"""Which transport reaches a peer, and which host this process is on.

The rule (issue 13): shm on the same host; else rdma when both sides have it; else the first of
the remaining transports, nixl and tcp, in the order the engine's config lists them
(`EngineConfig.transports`, a static ranking: put first the one messenger throughput measures
fastest on your wire, RESULTS.md "Messenger throughput"). A transport counts only when both
sides publish it (`PeerInfo.transports`) and it says it can reach the peer (`can_reach`: rdma
checks the fabric, shm the host).

"Same host" must mean "can share memory": two containers on one machine usually cannot (their
abstract sockets live in different network namespaces), so the host's identity includes the
network namespace, not only the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from messenger.api import NoTransport, PeerInfo, Transport

BOOT_ID = "/proc/sys/kernel/random/boot_id"
MACHINE_ID = "/etc/machine-id"
# Chosen by these rules before the configured order applies to the rest.
SAME_HOST, FABRIC = "shm", "rdma"


def host_id(boot_id_path: str = BOOT_ID, machine_id_path: str = MACHINE_ID,
            netns_path: str = "/proc/self/ns/net") -> str:
    """"<kernel boot id>/<network namespace inode>".

    The kernel's boot id, not /etc/machine-id, names the machine: every container on a host
    shares its kernel's boot id, and it is random per boot, whereas machine-id is often baked
    into an image and so the same on many hosts (it is only the fallback where the boot id
    cannot be read). The namespace inode alone would not do: the initial namespace's inode is
    the same number on every host.
    """
    machine = _read(boot_id_path) or _read(machine_id_path)
    if not machine:
        raise RuntimeError(f"cannot identify this host: neither {boot_id_path} nor {machine_id_path} is readable")
    try:
        netns = os.stat(netns_path).st_ino
    except OSError:
        netns = 0  # no namespaces (not Linux): the machine alone
    return f"{machine}/{netns}"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def choose(local: PeerInfo, peer: PeerInfo, transports: Mapping[str, Transport] | Iterable[Transport]) -> str:
    """The name of the transport to reach `peer` from `local`, among the started `transports`
    (name -> Transport, or a list), in the configured order. Raises NoTransport, saying what
    each candidate lacked."""
    ranked = list(transports.values() if isinstance(transports, Mapping) else transports)
    by_name = {t.name: t for t in ranked}
    order = [name for name in (SAME_HOST, FABRIC) if name in by_name]
    order += [t.name for t in ranked if t.name not in (SAME_HOST, FABRIC)]
    why: list[str] = []
    for name in order:
        if name == SAME_HOST and local.host_id != peer.host_id:
            why.append(f"{name}: another host")
        elif name not in local.transports or name not in peer.transports:
            side = "this side" if name not in local.transports else repr(peer.name)
            why.append(f"{name}: not published by {side}")
        elif not by_name[name].can_reach(local, peer):
            why.append(f"{name}: cannot reach it")
        else:
            return name
    raise NoTransport(f"no transport reaches {peer.name!r} from {local.name!r}: "
                      f"{'; '.join(why) or 'none started'}")
