"""Embedded registry over HTTP: a real uvicorn server, worker clients, conductor restarts."""

import asyncio
import socket
import time

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI

from mooncake.net import free_port
from mooncake.registry import ClusterView, MemoryRegistry, RegistryConfig, ViewConfig, encode_info, open_registry
from mooncake.registry.http import HttpRegistryClient, registry_router
from tests.registry.support import info, run, wait_until


class Conductor:
    """Just enough of a conductor: a FastAPI app with the registry routes, and a watcher
    feeding a ClusterView, the way the real one will."""

    def __init__(self, port: int, cfg: RegistryConfig) -> None:
        self.port, self.cfg = port, cfg
        self.registry = MemoryRegistry(cfg, sweep_interval_s=0.05)
        self.view = ClusterView(ViewConfig(expire_after_s=3 * cfg.ttl_s))

    async def start(self) -> None:
        app = FastAPI()
        app.include_router(registry_router(self.registry))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.serving = asyncio.create_task(self.server.serve(sockets=[sock]))
        self.watching = asyncio.create_task(self._watch())
        await wait_until(lambda: self.server.started, what="uvicorn start")

    async def _watch(self) -> None:
        async for ev in self.registry.watch():
            self.view.apply(ev, time.monotonic())

    async def stop(self) -> None:
        self.watching.cancel()
        self.server.should_exit = True
        await asyncio.gather(self.serving, self.watching, return_exceptions=True)

    def ids(self) -> set[str]:
        return {i.instance_id for i in self.view.instances()}


def test_workers_register_expire_and_survive_conductor_restart() -> None:
    async def main() -> None:
        port = free_port()
        cfg = RegistryConfig(url=f"embedded+http://127.0.0.1:{port}", ttl_s=1.0,
                             keepalive_interval_s=0.2, poll_interval_s=0.1,
                             retry_min_s=0.05, retry_max_s=0.2)
        conductor = Conductor(port, cfg)
        await conductor.start()
        w1, w2 = open_registry(cfg), open_registry(cfg)
        assert isinstance(w1, HttpRegistryClient)
        await w1.register(info("p0"), cfg.ttl_s)
        await w2.register(info("d0", "decode"), cfg.ttl_s)
        await wait_until(lambda: conductor.ids() == {"p0", "d0"}, what="both workers")
        assert [i.instance_id for i in conductor.view.instances("decode")] == ["d0"]

        # A remote watcher (polling) sees the same cluster, then an outage, then a resync.
        remote = HttpRegistryClient(cfg)
        remote_view, remote_kinds = ClusterView(), []

        async def follow() -> None:
            async for ev in remote.watch():
                remote_kinds.append(ev.kind)
                remote_view.apply(ev, time.monotonic())
        following = asyncio.create_task(follow())
        await wait_until(lambda: len(remote_view) == 2, what="remote watcher sync")
        assert (await remote.snapshot())["p0"] == conductor.view.get("p0")
        # Polling sees the keepalives as "alive" events.
        await wait_until(lambda: remote_kinds.count("alive") >= 4, what="alive events")

        # w2 stops heartbeating (as if it crashed): gone within about one TTL.
        await w2.close()
        waited = await wait_until(lambda: conductor.ids() == {"p0"}, timeout=4.0,
                                  what="d0 to expire")
        assert waited < cfg.ttl_s + 1.5, waited  # its TTL, the sweep, and a loaded machine's margin
        await asyncio.sleep(2 * cfg.keepalive_interval_s)
        assert conductor.ids() == {"p0"}, "the live worker must not expire"

        # The conductor restarts and forgets everything; w1 comes back on its own.
        await conductor.stop()
        await asyncio.sleep(0.4)  # long enough for the remote poller to notice
        conductor = Conductor(port, cfg)
        await conductor.start()
        await wait_until(lambda: conductor.ids() == {"p0"}, timeout=3.0, what="p0 back")
        await wait_until(lambda: remote_kinds[-1] != "outage" and "p0" in remote_view,
                         what="remote watcher resync")
        assert remote_kinds[0] == "resync" and "outage" in remote_kinds
        assert remote_kinds.count("resync") == 2

        # Graceful exit removes the entry at once.
        await w1.deregister("p0")
        await wait_until(lambda: conductor.ids() == set(), timeout=2.0, what="deregister")
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        for c in (w1, remote):
            await c.close()
        await conductor.stop()
    run(main())


def test_routes_reject_bad_input_and_unknown_instances() -> None:
    async def main() -> None:
        app = FastAPI()
        reg = MemoryRegistry()
        app.include_router(registry_router(reg))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            base = "/internal/registry/instances"
            assert (await c.post(f"{base}/nobody/heartbeat")).status_code == 404
            assert (await c.post(base, content=b"[")).status_code == 400
            resp = await c.post(base, json={"info": {"v": 1}, "ttl_s": 1})
            assert resp.status_code == 400 and "`instance_id`" in resp.json()["detail"]
            body = {"info": {"v": 1, "instance_id": "a", "role": "decode", "http_url": "u",
                             "kv_address": "h:1", "model": "m", "block_size": 16,
                             "kv_capacity_tokens": 8, "started_at": 0.0}, "ttl_s": 5}
            resp = await c.post(base, json={**body, "ttl_s": 0})  # MemoryRegistry.put refuses
            assert resp.status_code == 400 and "ttl_s" in resp.json()["detail"]
            resp = await c.post(base, json={**body, "ttl_s": 1e308})  # listed for ever, were it taken
            assert resp.status_code == 400 and "at most 3600 s" in resp.json()["detail"]
            resp = await c.post(base, json={**body, "info": {**body["info"], "v": 2}})
            assert resp.status_code == 400 and "$.info.v" in resp.json()["detail"]
            assert (await c.post(base, json=body)).status_code == 200
            assert (await c.post(f"{base}/a/heartbeat")).status_code == 200
            listed = (await c.get(base)).json()
            # A record without chunk_tokens (an older worker's) is listed with 0: "not said".
            assert listed == {"instances": [{**body["info"], "chunk_tokens": 0}], "v": 1}
            assert (await c.delete(f"{base}/a")).json() == {"removed": True}
            assert (await c.delete(f"{base}/a")).json() == {"removed": False}
    run(main())


def test_a_live_worker_whose_id_another_process_took_comes_back_when_that_one_dies(caplog) -> None:
    # Two processes with one --instance-id: the second's registration replaced the first's record,
    # and both heartbeats refreshed it. When the second died, the first's heartbeats kept the dead
    # one's record (its URL) listed for good, and the first, alive, was never routed again.
    async def main() -> None:
        port = free_port()
        cfg = RegistryConfig(url=f"embedded+http://127.0.0.1:{port}", ttl_s=1.0, keepalive_interval_s=0.2)
        conductor = Conductor(port, cfg)
        await conductor.start()
        a, b = open_registry(cfg), open_registry(cfg)
        first = info("p0")
        second = msgspec.structs.replace(first, http_url="http://127.0.0.1:1/elsewhere",
                                         started_at=first.started_at + 1)
        await a.register(first, cfg.ttl_s)
        await wait_until(lambda: conductor.view.get("p0") == first, what="a listed")
        await b.register(second, cfg.ttl_s)
        await wait_until(lambda: conductor.view.get("p0") == second, what="b took the id")
        await wait_until(lambda: "another process registered instance id p0" in caplog.text, what="a says so")
        await asyncio.sleep(3 * cfg.ttl_s)
        assert conductor.view.get("p0") == second  # a does not take it back while b lives
        await b.close()  # b dies without deregistering
        await wait_until(lambda: conductor.view.get("p0") == first, timeout=5.0, what="a listed again")
        await a.close()
        await conductor.stop()
    run(main())


def test_a_heartbeat_carrying_another_registrations_info_is_refused() -> None:
    async def main() -> None:
        app = FastAPI()
        reg = MemoryRegistry()
        app.include_router(registry_router(reg))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            base = "/internal/registry/instances"
            mine = info("a")
            reg.put(mine, 5.0)
            assert (await c.post(f"{base}/a/heartbeat", content=encode_info(mine))).status_code == 200
            other = msgspec.structs.replace(mine, http_url="http://127.0.0.1:1/other")
            resp = await c.post(f"{base}/a/heartbeat", content=encode_info(other))
            assert resp.status_code == 409 and "another process" in resp.json()["detail"]
            assert (await c.post(f"{base}/a/heartbeat")).status_code == 200  # an older worker sends no body
            resp = await c.post(f"{base}/b/heartbeat", content=encode_info(mine))
            assert resp.status_code == 400 and "'a'" in resp.json()["detail"]
            assert (await c.post(f"{base}/a/heartbeat", content=b"[")).status_code == 400
            reg.remove("a")
            assert (await c.post(f"{base}/a/heartbeat", content=encode_info(other))).status_code == 404
    run(main())
