"""EtcdRegistry against a real etcd: leases, watches, a crashed worker, an etcd restart."""

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake.registry import ClusterView, RegistryConfig, encode_info, open_registry
from mooncake.registry.etcd import EtcdRegistry
from tests.registry.support import info, run, wait_until

pytestmark = pytest.mark.etcd
REPO = Path(__file__).resolve().parents[2]


def cfg_for(server, **kw) -> RegistryConfig:
    base = dict(url=server.url, ttl_s=2.0, keepalive_interval_s=0.3, request_timeout_s=1.0,
                retry_min_s=0.05, retry_max_s=0.3)
    return RegistryConfig(**{**base, **kw})


class Follower:
    """A conductor-side watcher feeding a ClusterView, recording every event kind."""

    def __init__(self, registry) -> None:
        self.view, self.kinds = ClusterView(), []
        self.task = asyncio.create_task(self._run(registry))

    async def _run(self, registry) -> None:
        async for ev in registry.watch():
            self.kinds.append(ev.kind)
            self.view.apply(ev, time.monotonic())

    def ids(self) -> set[str]:
        return {i.instance_id for i in self.view.instances()}

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_register_watch_alive_deregister(etcd_server) -> None:
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        worker, conductor = open_registry(cfg), open_registry(cfg)
        assert isinstance(worker, EtcdRegistry)
        await worker.register(info("p0"), cfg.ttl_s)
        f = Follower(conductor)
        await wait_until(lambda: f.ids() == {"p0"}, what="initial resync")
        assert f.kinds[0] == "resync"
        d0 = info("d0", "decode")
        await worker.register(d0, cfg.ttl_s)
        await wait_until(lambda: f.ids() == {"p0", "d0"}, what="put d0")
        snap = await conductor.snapshot()
        assert snap["d0"] == d0 and snap["p0"].role == "prefill"

        # Key layout, as documented: both keys attached to one lease.
        keys = etcd_server.etcdctl("get", "--prefix", "/mooncake/v1/", "--keys-only").split()
        assert keys == ["/mooncake/v1/alive/d0", "/mooncake/v1/alive/p0",
                        "/mooncake/v1/instances/d0", "/mooncake/v1/instances/p0"]
        raw = json.loads(etcd_server.etcdctl("get", "/mooncake/v1/instances/p0", "-w", "json"))
        lease = raw["kvs"][0]["lease"]
        raw = json.loads(etcd_server.etcdctl("get", "/mooncake/v1/alive/p0", "-w", "json"))
        assert lease != 0 and raw["kvs"][0]["lease"] == lease

        # Liveness: the keepalive rewrites the alive key, so a live worker keeps sending
        # "alive" events and outlives several TTLs.
        await asyncio.sleep(2.5)
        assert f.ids() == {"p0", "d0"} and f.kinds.count("alive") >= 4

        await worker.deregister("d0")
        await wait_until(lambda: f.ids() == {"p0"}, timeout=3.0, what="delete d0")
        await f.stop()
        await worker.close()
        await conductor.close()
    run(main())


WORKER = """
import asyncio, sys, time
from mooncake.registry import InstanceInfo, RegistryConfig, open_registry
async def main():
    cfg = RegistryConfig(url=sys.argv[1], ttl_s=2.0, keepalive_interval_s=0.3)
    reg = open_registry(cfg)
    await reg.register(InstanceInfo("crashy", "decode", "http://x", "h:1", "m", 16, 8,
                                    time.time()), cfg.ttl_s)
    print("READY", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_crashed_worker_process_disappears_within_ttl(etcd_server) -> None:
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        conductor = open_registry(cfg)
        f = Follower(conductor)
        proc = subprocess.Popen([sys.executable, "-c", WORKER, etcd_server.url], cwd=REPO,
                                stdout=subprocess.PIPE, text=True)
        try:
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line.strip() == "READY"
            await wait_until(lambda: f.ids() == {"crashy"}, what="worker registered")
            await asyncio.sleep(1.0)  # alive past half a TTL: the keepalive works
            assert f.ids() == {"crashy"}
            proc.kill()  # SIGKILL: no deregister, no lease revoke
            waited = await wait_until(lambda: f.ids() == set(), timeout=cfg.ttl_s + 3,
                                      what="lease expiry")
            assert waited <= cfg.ttl_s + 1.5, waited
        finally:
            proc.kill()
            proc.wait()
        await f.stop()
        await conductor.close()
    run(main())


def test_etcd_restart_keeps_view_then_resyncs_and_lost_lease_reregisters(etcd_server) -> None:
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        worker, conductor = open_registry(cfg), open_registry(cfg)
        await worker.register(info("p0"), cfg.ttl_s)
        f = Follower(conductor)
        await wait_until(lambda: f.ids() == {"p0"}, what="initial sync")

        etcd_server.kill()
        await wait_until(lambda: "outage" in f.kinds, timeout=5.0, what="outage event")
        with pytest.raises(Exception):
            await conductor.snapshot()
        await asyncio.sleep(1.0)
        assert f.ids() == {"p0"} and f.view.outage_since is not None  # last view kept

        resyncs = f.kinds.count("resync")
        await asyncio.to_thread(etcd_server.start)  # same ports, same data dir
        await wait_until(lambda: f.kinds.count("resync") > resyncs, timeout=8.0,
                         what="resync after restart")
        assert f.view.outage_since is None and f.ids() == {"p0"}
        # The keepalive survived the outage: its liveness writes reach the watcher again.
        alive = f.kinds.count("alive")
        await wait_until(lambda: f.kinds.count("alive") >= alive + 2, timeout=3.0,
                         what="alive events after restart")

        # The lease is lost (revoked by an operator, or expired during a long partition):
        # the worker registers again by itself.
        lease = json.loads(etcd_server.etcdctl("get", "/mooncake/v1/instances/p0", "-w",
                                               "json"))["kvs"][0]["lease"]
        n_puts = f.kinds.count("put")
        etcd_server.etcdctl("lease", "revoke", format(lease, "x"))
        await wait_until(lambda: f.kinds.count("put") > n_puts, timeout=3.0,
                         what="re-registration")
        await wait_until(lambda: f.ids() == {"p0"}, what="p0 back")
        assert "delete" in f.kinds
        await f.stop()
        await worker.close()
        await conductor.close()
    run(main())


def keepalive_survives(etcd_server, disturb) -> None:
    """Register d0, run disturb(worker), then wait past the TTL: the keepalive must still be
    running and d0 never deleted (an unrefreshed lease would have expired by then)."""
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        worker, conductor = open_registry(cfg), open_registry(cfg)
        await worker.register(info("d0", "decode"), cfg.ttl_s)
        f = Follower(conductor)
        await wait_until(lambda: f.ids() == {"d0"}, what="initial sync")
        await disturb(worker, cfg)
        await asyncio.sleep(cfg.ttl_s * 1.5)
        keepalive = worker._regs["d0"].task
        assert keepalive is not None and not keepalive.done()
        assert f.ids() == {"d0"} and "delete" not in f.kinds
        await f.stop()
        await worker.close()  # a real cancel still stops the keepalive
        assert keepalive.done()
        await conductor.close()
    run(main())


@pytest.mark.parametrize("raised", [ValueError("Cannot invoke RPC on closed channel!"), asyncio.CancelledError()],
                         ids=["new-call-on-closed-channel", "call-in-flight-cancelled-by-close"])
def test_keepalive_survives_its_channel_being_closed_under_it(etcd_server, monkeypatch, raised) -> None:
    # Concurrent calls share one client; after a failure one of them closes it
    # while the other is using it. gRPC then raises ValueError in a new call, CancelledError in
    # a call in flight. Seen in CI after an etcd restart: the decode worker's keepalive ended
    # silently and its lease expired for good. The refresh here fails that way once.
    import aetcd

    real_refresh = aetcd.Client.refresh_lease
    failed = []

    async def refresh_failing_once(self, lease_id):
        if not failed:
            failed.append(lease_id)
            raise raised
        return await real_refresh(self, lease_id)

    monkeypatch.setattr(aetcd.Client, "refresh_lease", refresh_failing_once)

    async def until_failed(worker, cfg) -> None:
        await wait_until(lambda: bool(failed), what="the failed refresh")

    keepalive_survives(etcd_server, until_failed)


def test_compacted_watch_revision_takes_a_fresh_snapshot(etcd_server) -> None:
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        worker, conductor = open_registry(cfg), open_registry(cfg)
        await worker.register(info("p0"), cfg.ttl_s)
        await asyncio.sleep(5 * cfg.keepalive_interval_s)  # a few revisions to compact
        status = json.loads(etcd_server.etcdctl("endpoint", "status", "-w", "json"))
        etcd_server.etcdctl("compaction", str(status[0]["Status"]["header"]["revision"]))

        real_read_all, calls = conductor._read_all, []

        async def stale_first(client):
            snap, rev = await real_read_all(client)
            calls.append(rev)
            # First read pretends to be old: its revision is compacted by now, as when
            # compaction lands between a snapshot and its watch.
            return snap, (1 if len(calls) == 1 else rev)
        conductor._read_all = stale_first
        f = Follower(conductor)
        # etcd accepts the watch, then cancels it as compacted: the watcher reads again.
        await wait_until(lambda: len(calls) == 2 and f.kinds.count("resync") == 2,
                         what="second resync after compaction")
        assert f.kinds[:2] == ["resync", "resync"] and "outage" not in f.kinds
        assert f.ids() == {"p0"}
        await worker.register(info("d0", "decode"), cfg.ttl_s)
        await wait_until(lambda: f.ids() == {"p0", "d0"}, what="watch works afterwards")
        await f.stop()
        await worker.close()
        await conductor.close()
    run(main())


def test_a_live_worker_whose_id_another_process_took_comes_back_when_that_one_dies(etcd_server, caplog) -> None:
    # Two processes with one instance id (a force-deleted pod still running elsewhere): the
    # second's register overwrote the first's key, and when the second died its lease took the
    # key with it; the first, alive and keeping its own lease, stayed unroutable for good.
    async def main() -> None:
        cfg = cfg_for(etcd_server)
        a, b, conductor = open_registry(cfg), open_registry(cfg), open_registry(cfg)
        first, second = info("p0"), info("p0", "decode")
        await a.register(first, cfg.ttl_s)
        f = Follower(conductor)
        await wait_until(lambda: f.view.get("p0") == first, what="a routed")
        await b.register(second, cfg.ttl_s)
        await wait_until(lambda: f.view.get("p0") == second, what="b took the id")
        await wait_until(lambda: "another process registered instance id p0" in caplog.text, what="a says so")
        b._regs["p0"].task.cancel()  # b dies without deregistering: its lease runs out
        await wait_until(lambda: f.view.get("p0") == first, timeout=10.0, what="a routed again")
        await f.stop()
        for r in (a, b, conductor):
            await r.close()
    run(main())


def test_a_deregister_that_cancels_a_lease_regrant_revokes_the_new_lease_too(etcd_server) -> None:
    # The keepalive re-grants a lost lease; a deregister that cancels it after the new lease's
    # put committed, but before the registration learnt its id, left the instance listed on it.
    async def main() -> None:
        cfg = cfg_for(etcd_server, ttl_s=30.0, keepalive_interval_s=5.0)
        worker, conductor = open_registry(cfg), open_registry(cfg)
        await worker.register(info("p0"), cfg.ttl_s)
        reg = worker._regs["p0"]
        reg.task.cancel()  # no keepalive in the way
        # As if cancelled inside _grant_and_put, past the put: a new lease holds the keys.
        lease = await worker._run(lambda c: c.lease(30))
        await worker._run(lambda c: c.put(worker._ikey("p0"), encode_info(reg.info), lease=lease.id))
        assert set(await conductor.snapshot()) == {"p0"}
        reg.granting = lease.id
        await worker.deregister("p0")
        assert await conductor.snapshot() == {}
        for r in (worker, conductor):
            await r.close()
    run(main())
