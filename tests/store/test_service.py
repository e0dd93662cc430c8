"""PoolService with its arena and local channel (no messenger: remote=False): connectors, pins,
promotions, events and configure. The SSD tier's faults: test_service_ssd.py; the arena's sizing:
test_arena.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from store.arena import Arena
from store.channel import PoolClient, PoolUnavailable
from store.config import PoolConfig
from store.pool import checksum
from store.service import PoolService
from tests.store.service_support import BB, LAYOUT, ROOT, data, held_bytes, put, service


def test_another_process_maps_the_arena_and_saves_through_the_channel(svc):
    """What vLLM's worker does: attach the arena by path, fill reserved slots, commit."""
    endpoint = svc.endpoint
    code = textwrap.dedent(f"""
        import numpy as np
        from mooncake.control import ControlEndpoint
        from store.arena import Arena
        from store.channel import PoolClient
        from store.pool import checksum
        client = PoolClient(ControlEndpoint({endpoint.path!r}, {endpoint.authkey_hex!r}))
        arena = Arena.attach(client.configure({BB}, {LAYOUT!r}))
        slots = client.reserve([11, 12])
        for key, slot in slots:
            arena.slot(slot)[:] = np.random.default_rng(key).integers(0, 256, {BB}, dtype=np.uint8)
        print(client.commit([k for k, _ in slots], [checksum(arena.slot(s)) for _, s in slots]))
        print(client.lookup([11, 12, 13]))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["2", "['dram', 'dram']"]
    assert held_bytes(svc, [11, 12]) == [True, True]


def test_client_roundtrip_pins_and_releases(svc):
    client = PoolClient(svc.endpoint)
    try:
        assert client.lookup([1]) == []
        slots = client.reserve([1, 2])
        for key, slot in slots:
            svc.arena.slot(slot)[:] = data(key)
        assert client.commit([1], wait=False) is None
        assert client.commit([2]) == 1  # the service hashes the slots
        assert client.lookup([1, 2]) == ["dram", "dram"]
        got = client.read([1, 2, 3])
        assert [(k, c) for k, _, c in got] == [(1, checksum(data(1))), (2, checksum(data(2)))]
        assert svc.pool.pins(1) == 1
        client.release([1, 2])  # sent without an answer; the next call on the connection sees it done
        client.lookup([1])
        assert svc.pool.pins(1) == 0
        client.read([1])
        assert svc.stats()["usage"]["dram"]["blocks"] == 2
        with pytest.raises(PoolUnavailable, match="unknown pool op"):
            client._call({"op": "nonsense"})
        with pytest.raises(PoolUnavailable, match="layout"):
            client.configure(BB, "another-model")
    finally:
        client.close()
    # The connection is gone: its pins go with it.
    for _ in range(100):
        if svc.pool.pins(1) == 0:
            break
        import time
        time.sleep(0.01)
    assert svc.pool.pins(1) == 0


def test_a_release_naming_a_key_twice_takes_only_the_pins_its_connection_holds(svc):
    a, b = PoolClient(svc.endpoint), PoolClient(svc.endpoint)
    try:
        put(svc, [1])
        a.read([1])
        b.read([1])
        assert svc.pool.pins(1) == 2
        b.release([1, 1])  # b holds one pin: a's must stay, or the block could go mid-copy
        b.lookup([1])  # a round trip: the release is applied
        assert svc.pool.pins(1) == 1
    finally:
        a.close()
        b.close()


def test_wrong_key_is_refused(svc):
    from mooncake.control import ControlEndpoint

    with pytest.raises(PoolUnavailable):
        PoolClient(ControlEndpoint(svc.endpoint.path, "00" * 16)).lookup([1])


def test_eviction_spills_and_a_read_promotes_the_same_bytes(svc):
    keys = list(range(1, 11))
    for key in keys:
        put(svc, [key])
    svc.flush()
    tiers = svc.lookup(keys)
    assert tiers == ["ssd"] * 6 + ["dram"] * 4
    assert held_bytes(svc, keys[:4]) == [True] * 4  # promoted, each verified
    assert held_bytes(svc, keys) == [True] * 4  # 4 DRAM slots: a pinned read stops when they are all pinned
    for i in range(0, 10, 2):
        assert held_bytes(svc, keys[i:i + 2]) == [True, True]
    assert svc.stats()["counters"]["promotions"] >= 6


@pytest.mark.parametrize("policy", ["fifo", "lru"])
def test_tiers_under_pressure_never_lose_a_block_the_index_holds(tmp_path, policy):
    """Both tiers small and full, so one call evicts from SSD and spills again, and promotions
    find the SSD tier's own victim: whatever the index still holds reads back intact. (Deletes
    were queued after the plan's spills, which removed a file just written again; a promotion
    could evict the very file it read.)"""
    config = PoolConfig(dram_bytes=2 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=2 * BB, policy=policy)
    s = PoolService(config, remote=False).start()
    s.configure(BB, LAYOUT)
    try:
        for round_ in range(12):
            put(s, [round_ * 2 + 1, round_ * 2 + 2])
            s.flush()
            for key in range(1, round_ * 2 + 3):
                if s.lookup([key]):
                    assert held_bytes(s, [key]) == [True], (policy, round_, key)
                    s.flush()
        assert s.stats()["counters"]["corrupt"] == 0
    finally:
        s.close()


def test_a_promotion_that_raises_leaves_no_slot_loading_and_no_pin(svc, monkeypatch):
    """Anything a promotion raises (the tier turned off under it, a bug) ends the read with the
    error, but the slot leaves LOADING and the blocks read before it are unpinned."""
    keys = list(range(1, 9))
    for key in keys:
        put(svc, [key])
    svc.flush()
    assert svc.lookup(keys[:2]) == ["ssd", "ssd"] and svc.lookup(keys[4:]) == ["dram"] * 4
    real = svc.ssd.read_into
    monkeypatch.setattr(svc.ssd, "read_into", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        svc.read([keys[4], keys[0]])  # a DRAM block, then one that must be promoted
    assert svc.pool.pins(keys[4]) == 0
    monkeypatch.setattr(svc.ssd, "read_into", real)
    assert held_bytes(svc, keys[4:]) == [True] * 4  # every slot usable: nothing stuck pinned or loading


def test_events_page_orders_stored_and_removed_per_tier(svc):
    put(svc, [1])
    page = svc.events_since(-1)
    assert page.reset and page.events == [("stored", 1, "dram")]
    for key in range(2, 7):
        put(svc, [key])
    svc.flush()
    later = svc.events_since(page.seq)
    assert not later.reset
    assert ("removed", 1, "dram") in later.events and ("stored", 1, "ssd") in later.events
    assert later.events.index(("removed", 1, "dram")) < later.events.index(("stored", 1, "ssd"))


def test_concurrent_connectors_never_read_wrong_bytes(tmp_path):
    """Four connectors save and load overlapping keys through spills and promotions at once;
    every block read must be the block saved under its key."""
    import random
    import threading

    s = service(tmp_path, dram_blocks=8, ssd_blocks=24)
    errors, reads = [], [0]

    def connector(seed):
        rng = random.Random(seed)
        client = PoolClient(s.endpoint)
        arena = Arena.attach(client.configure(BB, LAYOUT))
        try:
            for _ in range(150):
                keys = [rng.randrange(40) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.5:
                    slots = client.reserve(keys)
                    for key, slot in slots:
                        arena.slot(slot)[:] = data(key)
                    client.commit([k for k, _ in slots], [checksum(data(k)) for k, _ in slots])
                else:
                    got = client.read(keys)
                    for key, slot, digest in got:
                        if digest != checksum(data(key)) or not np.array_equal(arena.slot(slot), data(key)):
                            errors.append(key)
                        reads[0] += 1
                    client.release([k for k, _, _ in got])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=connector, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and reads[0] > 20
        stats = s.stats()
        assert stats["counters"]["spills"] > 0 and stats["counters"]["corrupt"] == 0
    finally:
        s.close()


def test_a_configure_that_fails_part_way_leaves_no_half_configured_pool(tmp_path, monkeypatch):
    # The messenger side failing to start (a port taken) used to leave the arena and index up: the
    # next configure then answered as if the pool were whole, with no remote side for good.
    import store.remote

    def refuse(self, service, engine_config=None):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(store.remote.RemotePool, "__init__", refuse)
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=4 * BB),
                    remote=True).start()
    try:
        for _ in range(2):  # every try fails the same way, and holds nothing after
            with pytest.raises(OSError, match="Address already in use"):
                s.configure(BB, LAYOUT)
            assert s.arena is None and s.pool is None and s.ssd is None and s.lookup([1]) == []
        monkeypatch.undo()
        s._want_remote = False
        s.configure(BB, LAYOUT)  # and it can still be configured once the cause is gone
        assert s.arena is not None and s.ssd is not None
    finally:
        s.close()


def test_configure_may_take_longer_than_a_call(tmp_path, monkeypatch):
    # The first configure rebuilds the SSD index (a header read per file: seconds for a full tier
    # on a cold disk); under the 2 s of an ordinary call the engine ran without the pool for good.
    # The copier gives it the load timeout (kv_connector/pool_copier.py).
    slow_open = PoolService._open_ssd

    def slow(self):
        time.sleep(0.5)
        slow_open(self)

    monkeypatch.setattr(PoolService, "_open_ssd", slow)
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=str(tmp_path / "ssd"), ssd_bytes=4 * BB),
                    remote=False).start()
    client = PoolClient(s.endpoint, timeout_s=0.1)
    try:
        info = client.configure(BB, LAYOUT, timeout_s=10.0)
        assert info.slots == 4 and client.lookup([1]) == []
    finally:
        client.close()
        s.close()


def test_a_pool_that_leaves_a_call_unanswered_is_not_asked_again_for_a_while(svc, monkeypatch):
    """A pool that takes calls but answers none (its process frozen) cost the full timeout on
    every lookup, on vLLM's scheduler thread. After one unanswered call, calls fail at once until
    the back-off has passed; then the pool is asked again."""
    from store.channel import PoolSilent

    now = [100.0]
    client = PoolClient(svc.endpoint, timeout_s=0.2, backoff_s=5.0, clock=lambda: now[0])
    answer = PoolService._answer
    stalled = threading.Event()

    def frozen(self, request, pins):
        if not stalled.is_set():
            stalled.wait(5.0)
        return answer(self, request, pins)

    try:
        assert client.lookup([1]) == []
        monkeypatch.setattr(PoolService, "_answer", frozen)
        with pytest.raises(PoolUnavailable, match="no answer within 0.2 s") as unanswered:
            client.lookup([1])
        assert not isinstance(unanswered.value, PoolSilent)
        started = time.monotonic()
        for op in (lambda: client.lookup([1]), lambda: client.reserve([1]), lambda: client.release([1])):
            with pytest.raises(PoolSilent, match="'lookup' failed: no answer within 0.2 s; asking again in 5.0 s"):
                op()
        assert time.monotonic() - started < 0.1  # failed at once, not after the timeout
        stalled.set()  # the pool answers again
        now[0] += 4.9
        with pytest.raises(PoolSilent):
            client.lookup([1])
        now[0] += 0.2
        assert client.lookup([1]) == []
        put(svc, [1])
        assert client.lookup([1]) == ["dram"]
    finally:
        stalled.set()
        client.close()


def test_a_pool_whose_process_is_frozen_fails_the_connect_in_time(tmp_path):
    """connect() into a frozen process's backlog succeeds; the HMAC challenge never comes. The
    pool's client (vLLM's scheduler thread) waited for it for ever."""
    import socket

    from mooncake.control import ControlEndpoint
    from store.channel import PoolSilent

    path = str(tmp_path / "frozen.sock")
    frozen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frozen.bind(path)
    frozen.listen(16)  # never accepts
    client = PoolClient(ControlEndpoint(path, "00" * 16), timeout_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(PoolUnavailable, match="answered no handshake within 0.3 s"):
            client.lookup([1, 2])
        with pytest.raises(PoolSilent):
            client.release([1])
        assert time.monotonic() - started < 2.0
    finally:
        client.close()
        frozen.close()


def test_a_configure_that_fails_after_restoring_the_ssd_tier_takes_back_its_events(tmp_path, monkeypatch):
    """The SSD scan's "stored" events stayed in the log after the rollback: the conductor (which
    pulls them) routed prefix hits to a pool that held nothing."""
    import store.remote

    ssd = str(tmp_path / "ssd")
    first = PoolService(PoolConfig(dram_bytes=1 * BB, ssd_dir=ssd, ssd_bytes=4 * BB), remote=False).start()
    first.configure(BB, LAYOUT)
    put(first, [1])
    put(first, [2])  # one slot: 1 spills to disk
    first.flush()
    assert first.stats()["usage"]["ssd"]["blocks"] == 1
    first.close()

    def refuse(self, service, engine_config=None):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(store.remote.RemotePool, "__init__", refuse)
    s = PoolService(PoolConfig(dram_bytes=4 * BB, ssd_dir=ssd, ssd_bytes=4 * BB), remote=True).start()
    try:
        with pytest.raises(OSError):
            s.configure(BB, LAYOUT)
        page = s.events_since(-1)
        assert page.events == [] and s.events.held("ssd") == 0, page
    finally:
        s.close()


def test_a_connection_forgets_the_keys_it_released(svc):
    client = PoolClient(svc.endpoint)
    try:
        put(svc, list(range(1, 9)))
        for key in range(1, 9):
            client.read([key])
            client.release([key])
        client.lookup([1])
        # The connection's own count of its pins (the service's thread holds it): nothing left.
        counters = [frame.f_locals["pins"] for frame in _serve_frames()]
        assert counters and all(not c for c in counters), counters
    finally:
        client.close()


def _serve_frames():
    import sys

    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "_serve" and "pins" in frame.f_locals:
                yield frame
                break
            frame = frame.f_back


def test_callers_that_give_up_mid_handshake_never_stop_the_pool_taking_connections(svc):
    """multiprocessing's Listener ran the handshake inside accept(): a caller that had left (a
    connector whose handshake timed out while the worker was frozen) made it raise
    BrokenPipeError, which the accept loop took for a closed listener. It ended, and no
    connector could connect again (CI: the decode worker's pool after test_worker_frozen)."""
    import socket

    for leave_after in (0, 1):
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(svc.endpoint.path)
            if leave_after:
                s.recv(64)  # the challenge, then gone without answering
            s.close()
    time.sleep(0.2)
    client = PoolClient(svc.endpoint, timeout_s=2.0)
    try:
        assert client.lookup([1]) == []
    finally:
        client.close()
