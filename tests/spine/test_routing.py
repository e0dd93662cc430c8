"""The router drives the real scheduling core with hand-built worker handles (no processes)."""

import pytest

from conductor.core.config import SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.index import PrefixIndex
from conductor.core.profile_table import load_profile
from conductor.core.scheduler import Scheduler
from conductor.errors import APIError
from conductor.membership import mirror_view
from conductor.metrics import ConductorMetrics
from conductor.routing import DEFAULT_BANDWIDTH_BPS, Route, Router, cluster_bandwidth_Bps
from conductor.workers import WorkerHandle, WorkerPool
from mooncake.hashing import hash_prompt_blocks
from mooncake.registry import ClusterView, InstanceInfo, RegistryEvent

BLOCK = 128


def pool_of(*specs: tuple[str, str]) -> WorkerPool:
    pool = WorkerPool()
    for name, role in specs:
        h = pool.add(f"http://{name}")
        h.instance_id, h.role, h.ready, h.block_size, h.kv_capacity_tokens = name, role, True, BLOCK, 100_000
    return pool


def router(pool: WorkerPool, index: PrefixIndex | None = None, **cfg) -> Router:
    config = SchedulerConfig(block_size=BLOCK, ttft_slo_s=cfg.pop("ttft", 60.0), tbt_slo_s=cfg.pop("tbt", 0.5),
                             default_decode_s=5.0, **cfg)
    est = Estimators.from_profile(load_profile("smollm2-135m-cpu"))
    return Router(pool, index or PrefixIndex(), Scheduler(config, est), ConductorMetrics())


def test_prefix_holder_wins_and_ledger_tracks_the_request():
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    prompt = list(range(1000, 3000))
    index = PrefixIndex()
    index.apply_stored("p2", hash_prompt_blocks(prompt, BLOCK)[:12])
    r = router(pool, index)
    route = r.pick("req", prompt, 16, now=0.0)
    assert route.prefill.name == "p2" and route.decode.name == "d1"
    assert route.decision.cached_prefix_tokens == 12 * BLOCK
    p2, d1 = pool.handles["http://p2"], pool.handles["http://d1"]
    assert "req" in p2.ledger.prefill_jobs and "req" in d1.ledger.incoming
    assert r.metrics.value("mooncake_routes_total", kind="disaggregated") == 1 and r.metrics.value("mooncake_routes_total", kind="colocated") == 0
    r.first_token(route, now=1.0)
    assert "req" not in p2.ledger.prefill_jobs and "req" in d1.ledger.running
    r.finished(route, now=3.0)
    assert not d1.ledger.running and r._decoding == 0 and r.decode_time._count == 1
    r.finished(route, now=9.0)  # idempotent
    assert r._decoding == 0 and r.decode_time._count == 1


def test_decode_time_is_measured_by_littles_law_not_swayed_by_early_departures():
    """t_d, which prediction-based admission forecasts with, comes from the simulator's meter:
    nothing until 20 sequences left decode, then occupancy over departures. A client that
    leaves just after its first token is one departure among many, not the new t_d."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    gone = r.pick("gone", list(range(10)), 1, now=0.0)
    r.first_token(gone, now=0.1)
    r.finished(gone, now=0.11)  # its client left 10 ms after the first token
    assert r.decode_time.mean_decode_s(0.2) is None  # one departure measures nothing yet
    never = r.pick("never", list(range(20, 30)), 1, now=0.2)
    r.finished(never, now=0.3)  # ended before its first token: never decoded, not a departure
    assert r.decode_time._count == 1
    decoding, t = [], 1.0
    for i in range(40):  # one sequence every 2 s, each decoding for 10 s
        route = r.pick(f"r{i}", list(range(1000 + 20 * i, 1010 + 20 * i)), 1, now=t)
        r.first_token(route, now=t)
        decoding.append((t + 10.0, route))
        t += 2.0
        while decoding[0][0] <= t:
            end, route = decoding.pop(0)
            r.finished(route, now=end)
    assert 8.0 < r.decode_time.mean_decode_s(t) < 11.0


def test_queued_work_spreads_unrelated_requests():
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    r = router(pool)
    first = r.pick("a", list(range(5000, 6500)), 8, now=0.0)
    second = r.pick("b", list(range(7000, 8500)), 8, now=0.0)
    assert {first.prefill.name, second.prefill.name} == {"p1", "p2"}


def test_slo_rejection_is_429_with_retry_after_and_counted():
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool, ttft=0.01)
    with pytest.raises(APIError) as info:
        r.pick("a", list(range(2000)), 8, now=0.0)
    assert info.value.status == 429 and info.value.code == "ttft_slo"
    assert int(info.value.headers["Retry-After"]) >= 1
    assert r.metrics.value("mooncake_rejections_total", reason="ttft_slo", slo_class="default") == 1


def test_requests_refused_together_are_told_to_come_back_one_after_another():
    prompt = list(range(4000))
    one = router(pool_of(("p1", "prefill"), ("d1", "decode"))).pick("x", prompt, 8, now=0.0)
    alone = one.decision.predicted_ttft_s  # one prompt's TTFT on an idle cluster
    r = router(pool_of(("p1", "prefill"), ("d1", "decode")), ttft=1.5 * alone)
    r.pick("first", prompt, 8, now=0.0)  # admitted: its prefill is now queued on p1
    waits = []
    for i in range(4):
        with pytest.raises(APIError) as info:
            r.pick(f"r{i}", [10_000 * (i + 1) + t for t in range(4000)], 8, now=0.0)
        assert info.value.status == 429 and info.value.code == "ttft_slo"
        waits.append(int(info.value.headers["Retry-After"]))
        assert f"retry after {waits[-1]} s" in info.value.message
    # Alone, each would be told the same drain; booked, each one prefill later than the one before.
    assert waits == sorted(waits) and waits[-1] - waits[0] >= int(3 * alone)
    assert r.retries.backlog_s(0.0)["prefill"] == pytest.approx(waits[-1] + alone, abs=1.0)
    # --no-retry-spacing: each is told its own drain, the same for all.
    off = router(pool_of(("p1", "prefill"), ("d1", "decode")), ttft=1.5 * alone, space_retries=False)
    off.pick("first", prompt, 8, now=0.0)
    same = set()
    for i in range(3):
        with pytest.raises(APIError) as info:
            off.pick(f"r{i}", [10_000 * (i + 1) + t for t in range(4000)], 8, now=0.0)
        same.add(info.value.headers["Retry-After"])
    assert len(same) == 1 and off.retries.backlog_s(0.0) == {}


def test_no_decode_worker_is_503_and_no_prefill_degrades_to_colocated():
    with pytest.raises(APIError) as info:
        router(pool_of(("p1", "prefill"))).pick("a", [1, 2, 3], 4, now=0.0)
    assert info.value.status == 503
    alone = router(pool_of(("d1", "decode"), ("d2", "decode")))
    route = alone.pick("a", list(range(3000)), 4, now=0.0)
    assert route.colocated and route.decode.name in ("d1", "d2")
    assert alone.metrics.value("mooncake_routes_total", kind="colocated") == 1
    # The colocated prompt's prefill is queued work on its decode worker: the next goes to the other.
    assert alone.pick("b", list(range(5000, 8000)), 4, now=0.0).decode.name != route.decode.name


def test_decode_only_pool_still_refuses_what_breaks_the_ttft_slo():
    alone = router(pool_of(("d1", "decode")), ttft=0.01)
    with pytest.raises(APIError) as info:
        alone.pick("a", list(range(3000)), 4, now=0.0)
    assert info.value.status == 429 and info.value.code == "ttft_slo"
    assert alone.pick("b", list(range(3000)), 4, now=0.0, allow_none=True) is None


def test_excluded_instances_are_not_chosen():
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    route = router(pool).pick("a", list(range(3000)), 4, now=0.0, exclude={"p1"})
    assert route.prefill.name == "p2"


def test_mirror_view_adds_registered_and_drops_expired_but_keeps_static():
    pool, index, view = WorkerPool(), PrefixIndex(), ClusterView()
    pool.add("http://static:1", static=True)
    info = InstanceInfo("w1", "prefill", "http://w1:1", "w1:2", "m", BLOCK, 1000, 0.0)
    view.apply(RegistryEvent("resync", snapshot={"w1": info}), now=0.0)
    mirror_view(view, pool, index, now=0.0)
    assert pool.handles["http://w1:1"].kv_address == "w1:2"
    index.apply_stored("w1", [1, 2, 3])
    view.apply(RegistryEvent("delete", instance_id="w1"), now=1.0)
    mirror_view(view, pool, index, now=1.0)
    assert set(pool.handles) == {"http://static:1"} and index.block_count("w1") == 0


def test_a_worker_restarted_on_its_url_with_a_new_id_leaves_nothing_under_the_old_one():
    """The restart registers before the old lease runs out: both ids are alive on one URL for a
    while. The newest one is the handle's, whichever order the view lists them in, and the old
    id's blocks leave the prefix index at once (that process and its KV are gone)."""
    pool, index, view = WorkerPool(), PrefixIndex(), ClusterView()
    old = InstanceInfo("w-zzz", "prefill", "http://w1:1", "w1:2", "m", BLOCK, 1000, 0.0)  # sorts after the new id
    view.apply(RegistryEvent("resync", snapshot={"w-zzz": old}), now=0.0)
    mirror_view(view, pool, index, now=0.0)
    handle = pool.handles["http://w1:1"]
    handle.events_seq = 7
    index.apply_stored("w-zzz", [1, 2, 3])
    new = InstanceInfo("w-aaa", "prefill", "http://w1:1", "w1:2", "m", BLOCK, 1000, 5.0)
    view.apply(RegistryEvent("put", instance_id="w-aaa", info=new), now=5.0)
    for t in (5.0, 6.0, 7.0):
        mirror_view(view, pool, index, now=t)
        assert handle.name == "w-aaa" and index.block_count("w-zzz") == 0
    assert handle.events_seq == -1  # the new instance's blocks come from a full snapshot


def test_a_restart_seen_by_the_health_poll_also_clears_the_old_ids_blocks():
    """A static worker (--prefill-url) is in no registry: its /health tells its new id."""
    import asyncio
    import itertools

    from conductor.membership import poll_health

    pool, index = WorkerPool(), PrefixIndex()
    handle = pool.add("http://w1:1", static=True)
    ids = itertools.chain(["w-old", "w-old"], itertools.repeat("w-new"))

    class Health:
        async def check(self, h):
            h.instance_id, h.ready = next(ids), True

    async def main():
        poller = asyncio.create_task(poll_health(pool, Health(), index, 0.01))
        while handle.name != "w-old":
            await asyncio.sleep(0.001)
        index.apply_stored("w-old", [1, 2, 3])
        handle.events_seq = 7
        while handle.name != "w-new":  # (the poll looks at names right after its checks, before it sleeps)
            await asyncio.sleep(0.001)
        poller.cancel()

    asyncio.run(asyncio.wait_for(main(), 5))
    assert index.block_count("w-old") == 0 and handle.events_seq == -1


def test_a_worker_that_goes_down_leaves_the_prefix_index_at_once():
    """A worker restarted under its own name (serve's decode-1, a static --decode-url) answers
    /health ready before its KV events follower has taken a snapshot: its old blocks must be gone
    by then, or a route skips pushing blocks the new process does not hold."""
    import asyncio

    from conductor.membership import poll_health

    pool, index = WorkerPool(), PrefixIndex()
    handle = pool.add("http://w1:1", static=True)
    states = iter([True, False])

    class Health:
        async def check(self, h):
            h.instance_id, h.ready = "decode-1", next(states, False)

    async def main():
        poller = asyncio.create_task(poll_health(pool, Health(), index, 0.01))
        while not handle.ready:
            await asyncio.sleep(0.001)
        index.apply_stored("decode-1", [1, 2, 3])
        handle.events_seq = 7
        while handle.ready:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.005)  # the poll looks at readiness right after its checks
        poller.cancel()

    asyncio.run(asyncio.wait_for(main(), 5))
    assert index.block_count("decode-1") == 0 and handle.events_seq == -1


def test_a_registered_workers_step_size_reaches_the_scheduler():
    pool, index, view = WorkerPool(), PrefixIndex(), ClusterView()
    info = InstanceInfo("d1", "decode", "http://d1:1", "d1:2", "m", BLOCK, 100_000, 0.0, chunk_tokens=256)
    view.apply(RegistryEvent("resync", snapshot={"d1": info}), now=0.0)
    mirror_view(view, pool, index, now=0.0)
    handle = pool.handles["http://d1:1"]
    handle.ready = True
    assert handle.chunk_tokens == 256
    assert router(pool)._instance(handle, now=0.0).chunk_tokens == 256


def test_a_static_workers_step_size_reaches_the_scheduler_from_its_health(tmp_path):
    """A --decode-url worker is in no registry: its /health says its engine's step."""
    import asyncio

    import httpx

    from conductor.workers import WorkerClient
    from mooncake.control import ControlEndpoint
    from mooncake.engine.app import create_app
    from mooncake.engine.config import WorkerConfig

    config = WorkerConfig(role="decode", model="m", served_model_name="m", max_num_batched_tokens=256)
    app = create_app(config, 1, 2, ControlEndpoint(str(tmp_path / "none.sock"), "00" * 16))
    pool = WorkerPool()
    handle = pool.add("http://d1")

    async def run():
        client = WorkerClient(token_timeout_s=5.0)
        await client.close()
        client._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        await client.check(handle)  # 503: its engine is not started here, but it says its step
        await client.close()

    asyncio.run(run())
    assert handle.chunk_tokens == 256
    handle.ready = True
    assert router(pool)._instance(handle, now=0.0).chunk_tokens == 256


def test_a_busy_holders_prefix_is_fetched_from_its_pool_only_when_its_pool_serves_others():
    """Algorithm 1's fetch_from through the router: p2 holds 12 blocks but has seconds of prefill
    queued, so idle p1 is sent with a FetchParams naming p2's pool; a p2 whose /health named no
    pool_peer is never priced as a holder, and p1 then computes the whole prompt."""
    prompt = list(range(1000, 3000))
    for pool_peer in ('{"host": "p2", "port": 9}', None):
        pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
        p2 = pool.handles["http://p2"]
        p2.pool_peer = pool_peer
        index = PrefixIndex()
        index.apply_stored("p2", hash_prompt_blocks(prompt, BLOCK)[:12])
        r = router(pool, index, remote_fetch=True)
        assert r._instance(p2, now=0.0).serves_fetches is (pool_peer is not None)
        busy = r.pick("busy", list(range(5000, 9000)), 8, now=0.0, exclude={"p1"})  # seconds of work on p2
        assert busy.prefill is p2 and p2.ledger.backlog_s > 5
        route = r.pick("req", prompt, 16, now=0.0)
        assert route.prefill.name == "p1", route.decision
        if pool_peer is None:
            assert route.fetch is None and route.decision.fetch_from is None
            assert route.decision.cached_prefix_tokens == 0
            assert r.metrics.value("mooncake_prefix_fetches_total") == 0
        else:
            assert route.decision.fetch_from == "p2" and route.decision.fetched_blocks == 12
            assert route.fetch.peer == pool_peer and route.fetch.num_tokens == 12 * BLOCK
            assert r.metrics.value("mooncake_prefix_fetches_total") == 1
            assert r.metrics.value("mooncake_prefix_fetch_tokens_total") == 12 * BLOCK


def test_a_worker_never_measured_is_priced_at_the_measured_workers_median_bandwidth():
    """A decode worker never pushes, yet a pool fetch from it crosses the same wire: it is priced
    at what the measured workers push at, not at the 2 GB/s default (3x the rate measured here)."""
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("p3", "prefill"), ("d1", "decode"))
    assert cluster_bandwidth_Bps(pool.all()) == DEFAULT_BANDWIDTH_BPS
    for name, Bps in (("p1", 0.6e9), ("p2", 1.0e9), ("p3", 5e9)):
        pool.handles[f"http://{name}"].push_bandwidth.estimate_Bps = Bps
    r = router(pool)
    seen = []
    schedule = r.scheduler.schedule
    r.scheduler.schedule = lambda request, state, now: seen.append(state) or schedule(request, state, now)
    r.pick("a", list(range(1000, 1300)), 8, now=0.0)
    priced = {inst.instance_id: inst.bandwidth_Bps for inst in seen[0].instances}
    assert priced == {"p1": 0.6e9, "p2": 1.0e9, "p3": 5e9, "d1": 1.0e9}


def test_a_prefill_in_flight_counts_as_cache_for_the_next_request_on_that_worker():
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    r = router(pool, policy="cache-aware")
    shared = list(range(1000, 2920))  # 15 blocks of 128
    first = r.pick("a", shared + [5, 6, 7], 8, now=0.0)
    other = "p2" if first.prefill.name == "p1" else "p1"
    busy = pool.handles[f"http://{other}"].ledger
    busy.assign("busy", busy, 30.0, 0.0, 1)  # keep the other worker busy for 30 s
    second = r.pick("b", shared + [8, 9], 8, now=0.0)
    # No KV event has reported the shared blocks yet; the router knows `a` will have stored them.
    assert second.prefill is first.prefill and second.decision.cached_prefix_tokens == 15 * BLOCK
    r.first_token(first, now=1.0)
    r.finished(second, now=1.0)  # e.g. its prefill failed: its pending blocks go too
    assert len(r.pending) == 0
    r.finished(first, now=2.0)
    assert len(r.pending) == 0


def test_pending_prefixes_go_even_when_the_worker_is_renamed_in_flight():
    """A worker restarted on the same URL registers a new instance id; the conductor renames its
    handle in place. The blocks routed to it are pending under the old name and must go with it."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    routes = [r.pick(f"q{i}", list(range(i * 10_000, i * 10_000 + 2048)), 16, now=0.0) for i in range(3)]
    assert len(r.pending) > 0
    pool.handles["http://p1"].instance_id = "p1-restarted"
    for route in routes:
        r.first_token(route, now=1.0)
        r.finished(route, now=2.0)
    assert len(r.pending) == 0


def test_a_worker_with_another_block_size_is_never_routed_to(caplog):
    pool = pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))
    pool.handles["http://p2"].block_size = BLOCK * 2  # registered with --block-size 256
    prompt = list(range(1000, 3000))
    index = PrefixIndex()
    index.apply_stored("p2", hash_prompt_blocks(prompt, BLOCK)[:12])  # would win on its prefix
    r = router(pool, index)
    for i in range(3):
        assert r.pick(f"r{i}", prompt, 8, now=0.0).prefill.name == "p1"
    refusals = [rec for rec in caplog.records if "not routing to p2" in rec.getMessage()]
    assert len(refusals) == 1 and "--block-size 128" in refusals[0].getMessage()  # said once, with the fix


def test_flexible_roles_put_p_equals_d_on_the_prefill_worker_when_decode_is_full():
    from conductor.core.types import DecodeSeq

    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    d1, p1 = pool.handles["http://d1"], pool.handles["http://p1"]
    d1.ledger.running["old"] = DecodeSeq(0.0, 99_000)  # 100k KV capacity: no room for 2,016 more
    prompt = list(range(2000))
    with pytest.raises(APIError) as info:
        router(pool, admission="early").pick("a", prompt, 16, now=0.0)
    assert info.value.status == 429 and info.value.code == "no_capacity"
    r = router(pool, admission="early", flexible_roles=True)
    route = r.pick("b", prompt, 16, now=0.0)
    assert route.colocated and route.prefill is p1
    assert r.metrics.value("mooncake_routes_total", kind="colocated") == 1
    assert "b" in p1.ledger.prefill_jobs and "b" in p1.ledger.incoming and "b" not in d1.ledger.incoming
    r.first_token(route, now=1.0)
    assert not p1.ledger.prefill_jobs and "b" in p1.ledger.running
    r.finished(route, now=2.0)
    assert not p1.ledger.running and not p1.ledger.incoming


def test_flexible_roles_serve_with_only_prefill_workers():
    r = router(pool_of(("p1", "prefill")), flexible_roles=True)
    route = r.pick("a", list(range(300)), 4, now=0.0)
    assert route.colocated and route.prefill.name == "p1"


def test_the_first_token_feeds_the_prefill_instance_ttft_residual():
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    r = router(pool)
    route = r.pick("a", list(range(1000, 3500)), 8, now=10.0)
    predicted = route.decision.predicted_ttft_s
    assert predicted > 1.0 and route.decided_at == 10.0 and route.ttft_residual == 1.0
    r.first_token(route, now=10.0 + 2 * predicted)  # twice as long as predicted
    p1 = r.calibration.instance("p1")
    assert p1.ttft_residual.samples == 1 and p1.ttft_residual.scale == pytest.approx(2 ** (1 / 5))  # shrunk 1/(1+4)
    # The next request's prefill is priced, and queued in the ledger, with the residual.
    nxt = r.pick("b", list(range(5000, 7500)), 8, now=20.0)
    assert nxt.ttft_residual == p1.ttft_residual.scale
    assert nxt.prefill.ledger.prefill_jobs["b"] == pytest.approx(
        p1.ttft_residual.scale * r.scheduler.estimators.prefill_s(2500, 0))
    # A prefill instance that left the pool learns nothing more.
    pool.remove("http://p1")
    r.first_token(nxt, now=30.0)
    assert p1.ttft_residual.samples == 1


def test_where_cached_names_each_holder_its_prefix_and_its_pool_only_blocks():
    pool = pool_of(("p1", "prefill"), ("d1", "decode"))
    prompt = list(range(1000, 1000 + 5 * BLOCK + 7))  # five whole blocks and a partial one
    hashes = hash_prompt_blocks(prompt, BLOCK)
    index = PrefixIndex()
    index.apply_stored("p1", [*hashes[:2], *hashes[3:]])  # blocks 3-4 follow a gap: no prefix
    index.apply_stored("d1", hashes[:4], {h: "ssd" for h in hashes[2:4]})  # blocks 2-3 only in its pool
    where = router(pool, index).where_cached(prompt)
    assert where["prompt_tokens"] == len(prompt) and where["block_size"] == BLOCK and where["blocks"] == 5
    assert where["instances"] == [
        {"instance": "d1", "url": "http://d1", "cached_blocks": 4, "pool_only_blocks": {"ssd": 2}},
        {"instance": "p1", "url": "http://p1", "cached_blocks": 2, "pool_only_blocks": {}}]
    assert router(pool, index).where_cached(list(range(9000, 9000 + BLOCK)))["instances"] == []


def test_a_request_whose_decode_worker_failed_is_counted_on_the_worker_that_took_it_over():
    """The relay's decode fallback (Relay on_moved): the sequence, and for a colocated route its
    prompt's queued prefill and pending blocks, leave the failed worker's ledger for the new one."""
    pool = pool_of(("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    r = router(pool)
    p1, d1, d2 = (pool.handles[f"http://{n}"] for n in ("p1", "d1", "d2"))
    route = r.pick("req", list(range(1000, 3000)), 16, now=0.0)
    failed, spare = (d1, d2) if route.decode is d1 else (d2, d1)
    assert not route.colocated and "req" in failed.ledger.incoming
    r.move_decode(route, spare, now=0.5)
    assert route.decode is spare and "req" not in failed.ledger.incoming and "req" in spare.ledger.incoming
    assert "req" in p1.ledger.prefill_jobs  # the prefill is where it was
    r.first_token(route, now=1.0)
    assert "req" in spare.ledger.running and not failed.ledger.running
    r.finished(route, now=2.0)
    assert not spare.ledger.running and r._decoding == 0

    prompt = list(range(5000, 7000))
    colocated = r._commit(Route(failed, failed, "solo", blocks=tuple(hash_prompt_blocks(prompt, BLOCK))),
                          prompt, 16, now=3.0, cached=0, tbt_slo_s=0.5)  # P = D, as flexible roles may pick
    seconds = failed.ledger.prefill_jobs["solo"]
    r.move_decode(colocated, spare, now=3.5)
    assert colocated.prefill is spare and colocated.decode is spare and colocated.pending_on == spare.name
    assert "solo" not in failed.ledger.prefill_jobs and spare.ledger.prefill_jobs["solo"] == seconds
    assert "solo" in spare.ledger.incoming and "solo" not in failed.ledger.incoming
    assert r.pending.match(colocated.blocks) == {spare.name: len(colocated.blocks)}
    r.finished(colocated, now=5.0)
    assert not spare.ledger.prefill_jobs and not spare.ledger.incoming and len(r.pending) == 0
    r.move_decode(colocated, failed, now=6.0)  # after it ended: nothing moves
    assert colocated.decode is spare
