"""The conductor's membership through etcd faults an operator meets: etcd frozen (a stopped VM,
a disk stall: the watch neither ends nor speaks), and a worker frozen past its lease (a long GC
pause, SIGSTOP). The conductor side is the real one (conductor.membership.follow_registry into a
WorkerPool), the etcd is real."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conductor.core.index import PrefixIndex
from conductor.membership import follow_registry
from conductor.workers import WorkerPool
from mooncake.registry import ClusterView, RegistryConfig, ViewConfig, open_registry
from tests.registry.support import info, run, wait_until

pytestmark = pytest.mark.etcd
REPO = Path(__file__).resolve().parents[2]


def test_a_frozen_etcd_drops_no_worker_from_routing(etcd_server) -> None:
    # The workers refresh at their own times within a keepalive interval. When etcd froze, the
    # view's net dropped every worker but the last one heard from before the whole registry
    # counted as silent: the conductor routed to 1 worker of 4 until etcd came back.
    async def main() -> None:
        cfg = RegistryConfig(url=etcd_server.url, ttl_s=2.0, keepalive_interval_s=1.0, request_timeout_s=1.0,
                             retry_min_s=0.05, retry_max_s=0.3)
        ids = [f"p{i}" for i in range(4)]
        workers = []
        for iid in ids:  # spread over the keepalive interval
            workers.append(open_registry(cfg))
            await workers[-1].register(info(iid), cfg.ttl_s)
            await asyncio.sleep(cfg.keepalive_interval_s / len(ids))
        conductor = open_registry(cfg)
        view, pool = ClusterView(ViewConfig(expire_after_s=2 * cfg.ttl_s)), WorkerPool()  # as conductor/app.py
        following = asyncio.create_task(follow_registry(conductor, view, pool, PrefixIndex()))

        def routed() -> set[str]:
            return {h.instance_id for h in pool.all()}
        await wait_until(lambda: routed() == set(ids), what="all workers routed")
        await asyncio.sleep(2 * cfg.keepalive_interval_s)
        os.kill(etcd_server.proc.pid, signal.SIGSTOP)
        try:
            seen = set(ids)
            until = time.monotonic() + 2 * cfg.ttl_s + 3.0  # past the view's window, with expire ticks
            while time.monotonic() < until:
                seen &= routed()
                await asyncio.sleep(0.05)
            assert seen == set(ids), f"dropped while etcd was frozen: {sorted(set(ids) - seen)}"
        finally:
            os.kill(etcd_server.proc.pid, signal.SIGCONT)
        # Thawed, etcd ends the leases that lapsed meanwhile; the workers register again.
        await wait_until(lambda: routed() == set(ids) and view.outage_since is None, timeout=10.0,
                         what="all workers routed after the thaw")
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        for r in (*workers, conductor):
            await r.close()
    run(main(), timeout=60.0)


WORKER = """
import asyncio, sys, time
from mooncake.registry import InstanceInfo, RegistryConfig, open_registry
async def main():
    cfg = RegistryConfig(url=sys.argv[1], ttl_s=2.0, keepalive_interval_s=0.5)
    reg = open_registry(cfg)
    await reg.register(InstanceInfo("frozen", "decode", "http://x", "h:1", "m", 16, 8, time.time()), cfg.ttl_s)
    print("READY", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_worker_frozen_past_its_lease_registers_again_when_it_thaws(etcd_server) -> None:
    async def main() -> None:
        cfg = RegistryConfig(url=etcd_server.url, ttl_s=2.0, keepalive_interval_s=0.5, retry_min_s=0.05,
                             retry_max_s=0.3)
        conductor = open_registry(cfg)
        view, kinds = ClusterView(ViewConfig(expire_after_s=2 * cfg.ttl_s)), []

        async def follow() -> None:
            async for ev in conductor.watch():
                kinds.append(ev.kind)
                view.apply(ev, time.monotonic())
        following = asyncio.create_task(follow())
        proc = subprocess.Popen([sys.executable, "-c", WORKER, etcd_server.url], cwd=REPO, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "READY"
            await wait_until(lambda: "frozen" in view, what="registered")
            os.kill(proc.pid, signal.SIGSTOP)
            await wait_until(lambda: "frozen" not in view, timeout=cfg.ttl_s + 3, what="its lease to expire")
            puts = kinds.count("put")
            os.kill(proc.pid, signal.SIGCONT)
            await wait_until(lambda: "frozen" in view and kinds.count("put") > puts, timeout=5.0,
                             what="registered again")
        finally:
            proc.kill()
            proc.wait()
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        await conductor.close()
    run(main())
