"""The KVCache pool's put and get, next to Mooncake Store, in one run (issue #14).

    python -m benchmarks.store_bench            # 64 KiB and 4 MiB blocks, ours and Mooncake Store
    python -m benchmarks.store_bench --quick    # fewer operations (a smoke run, seconds)
    python -m benchmarks.store_bench --no-peer  # ours only
    python -m benchmarks.store_bench --results-md   # and write the tables into RESULTS.md

What is measured, per block size (ops/s and GB/s, wall time around the calls only):
- ours, local (what a connector in vLLM's worker does): the pool service runs in its own
  process, this one maps its arena and talks over the local channel. put = reserve, copy the
  block into its slot, xxh3-64 of it, commit (sent without waiting, as the connector's saver
  does; one lookup after the loop waits for them all). get = read (pinned), copy out of the
  slot, verify its checksum, release (no answer awaited). batch get = 16 keys per call.
- ours, remote: this process runs a second pool and fetches the first pool's blocks: get =
  fetch_remote of one key, batch get = of 16 keys; each block is verified against its checksum
  before it is committed here. Three ways: through the messenger over tcp on loopback (what
  reaches another machine), through the messenger with the engine's choice for a same-host
  peer (shm), and out of the peer's arena mapped here (store/peer_arena.py, what a pool does
  with a same-host peer by default).
- Mooncake Store (mooncake-transfer-engine-non-cuda, tcp, its master and HTTP metadata server
  started here on loopback): local = one client putting into and getting from its own segment
  (put_from, get_into, batch_get_into of 16, registered buffers); remote = a holder process
  whose segment has the objects and a getter that mounts none; its remote put lands in the
  holder's segment. Our pool has no remote put: a node writes only its own pool, others fetch.
- the index alone: our BlockPool against vLLM's CPUOffloadingManager (the scheduler-side
  index of its OffloadingConnector, LRU) on one request stream (lookups, pinned loads of the
  hits, stores of the misses with eviction), in process CPU time; and the SSD tier's files
  against the file I/O of vLLM's file-system tier: the measurements behind building our own
  rather than on vLLM's offloading.

Goals printed as ratios: remote get >= 2x Mooncake Store at 64 KiB, >= 1.5x at 4 MiB.
Absolute figures move with the machine; only the same run's ratios compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

from mooncake import defaults
from mooncake.control import ControlEndpoint
from mooncake.net import free_port

KIB, MIB = 1 << 10, 1 << 20
BATCH = 16
LAYOUT = "store-bench"
SERVE_MARK = "STORE-BENCH "
REPO = Path(__file__).resolve().parents[1]
GOALS = {64 * KIB: 2.0, 4 * MIB: 1.5}  # remote get, ours / Mooncake Store
# Our remote gets run three times: over tcp (what reaches another machine, and what Mooncake
# Store uses here), with the messenger's own choice for this peer (shm: same host), and out of
# the peer's arena (a pool's default for a same-host peer). (figure suffix, transports, mapped)
REMOTE_MODES = (("", ("tcp",), False), ("_auto", defaults.KV_TRANSPORTS, False),
                ("_arena", defaults.KV_TRANSPORTS, True))
REMOTE_SUFFIXES = tuple(suffix for suffix, _, _ in REMOTE_MODES)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Figures go to RESULTS.md, section 'KVCache pool (issue #14)'.")
    p.add_argument("--quick", action="store_true", help="few operations per figure (a smoke run)")
    p.add_argument("--no-peer", action="store_true", help="skip Mooncake Store")
    p.add_argument("--no-index", action="store_true", help="skip the comparisons of the index and the SSD tier's "
                   "files with vLLM's offloading")
    p.add_argument("--ssd-dir", default=None, help="where the SSD comparison writes (default: the temp directory)")
    p.add_argument("--sizes", default="64K,4M", help="block sizes, comma-separated (K and M suffixes)")
    p.add_argument("--peer-venv", default=None, help="the Mooncake venv (default: benchmarks/peers/venv.py's, "
                   "built on first use)")
    p.add_argument("--json", default=None, help="also write every figure to this file")
    p.add_argument("--results-md", action="store_true", help="also put the tables into benchmarks/RESULTS.md "
                   "(between its store-bench markers)")
    p.add_argument("--serve", nargs=2, type=int, metavar=("BLOCK_BYTES", "SLOTS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": KIB, "M": MIB}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def counts(block_bytes: int, quick: bool) -> int:
    if quick:
        return 64 if block_bytes <= 256 * KIB else 16
    return 2000 if block_bytes <= 256 * KIB else 64


def rate(n: int, nbytes: int, seconds: float) -> dict:
    return {"ops_per_s": n / seconds, "gb_per_s": nbytes / seconds / 1e9, "ops": n, "seconds": seconds}


# --- ours ---------------------------------------------------------------------------------
def serve(block_bytes: int, slots: int) -> None:
    """The pool under test, in its own process (as in a worker shell)."""
    from store.config import PoolConfig
    from store.service import PoolService

    service = PoolService(PoolConfig(dram_bytes=slots * block_bytes, ssd_dir=None)).start()
    service.configure(block_bytes, LAYOUT)
    # A marked line: libraries the messenger loads (NIXL) print to stdout too.
    print(SERVE_MARK + json.dumps({"path": service.endpoint.path, "key": service.endpoint.authkey_hex,
                                   "peer": msgspec.json.encode(service.peer_info()).decode()}), flush=True)
    sys.stdin.read()
    service.close()


def ours(block_bytes: int, count: int) -> dict:
    from messenger.api import PeerInfo
    from messenger.engine import EngineConfig
    from store.arena import Arena
    from store.channel import PoolClient
    from store.config import PoolConfig
    from store.pool import checksum
    from store.service import PoolService

    holder = subprocess.Popen([sys.executable, "-m", "benchmarks.store_bench", "--serve", str(block_bytes),
                               str(count + BATCH)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    getter = None
    try:
        hello = next((json.loads(line[len(SERVE_MARK):]) for line in holder.stdout if line.startswith(SERVE_MARK)),
                     None)
        if hello is None:
            raise SystemExit("the pool under test did not start")
        client = PoolClient(ControlEndpoint(hello["path"], hello["key"]))
        arena = Arena.attach(client.configure(block_bytes, LAYOUT))
        src = np.random.default_rng(0).integers(0, 256, (BATCH, block_bytes), dtype=np.uint8)
        dst = np.ones_like(src)  # touched: no page faults inside the timed loops
        keys = [2**127 + i for i in range(count)]
        figures = {}

        started = time.perf_counter()
        for i, key in enumerate(keys):
            for k, slot in client.reserve([key]):
                arena.slot(slot)[:] = src[i % BATCH]
                client.commit([k], [checksum(arena.slot(slot))], wait=False)  # a saver does not wait
        client.lookup(keys[-1:])  # the commits sent before it are applied
        figures["put"] = rate(count, count * block_bytes, time.perf_counter() - started)

        def get_local(batch: int) -> dict:
            n = count - count % batch
            started = time.perf_counter()
            for first in range(0, n, batch):
                got = client.read(keys[first:first + batch])
                for j, (_, slot, digest) in enumerate(got):
                    dst[j] = arena.slot(slot)
                    if checksum(dst[j]) != digest:
                        raise SystemExit("local get: checksum mismatch")
                client.release([k for k, _, _ in got])
                if len(got) != batch:
                    raise SystemExit(f"local get: {len(got)} of {batch} keys")
            return rate(n, n * block_bytes, time.perf_counter() - started)

        figures["get"] = get_local(1)
        figures["batch_get"] = get_local(BATCH)
        if not np.array_equal(dst[(count - 1) % BATCH], src[(count - 1) % BATCH]):
            raise SystemExit(f"local get returned wrong bytes {dst[:, :4]} {src[:, :4]}")

        peer = msgspec.json.decode(hello["peer"], type=PeerInfo)
        for label, transports, mapped in REMOTE_MODES:
            engine_config = EngineConfig(transports=transports, checksums=False)
            getter = PoolService(PoolConfig(dram_bytes=(count + BATCH) * block_bytes, ssd_dir=None,
                                            map_same_host_peers=mapped), engine_config=engine_config).start()
            getter.configure(block_bytes, LAYOUT)
            chosen = getter.remote.engine.add_peer(peer)
            for first in range(0, count, BATCH):  # warm-up: connections open, arena pages are touched
                getter.fetch_remote(peer, keys[first:first + BATCH])
            getter.remove(keys)
            if mapped:  # say so if the peer's arena could not be mapped after all
                chosen = "its arena" if getter.remote._peer_arenas._mapped else f"{chosen} (arena refused)"

            def get_remote(batch: int) -> dict:
                n = count - count % batch
                started = time.perf_counter()
                for first in range(0, n, batch):
                    if getter.fetch_remote(peer, keys[first:first + batch]) != batch:
                        raise SystemExit("remote get: a block did not arrive")
                seconds = time.perf_counter() - started
                getter.remove(keys)
                return {**rate(n, n * block_bytes, seconds), "transport": chosen}

            figures[f"remote_get{label}"] = get_remote(1)
            figures[f"remote_batch_get{label}"] = get_remote(BATCH)
            # Each block fetched was checked against its checksum before it was committed.
            figures[f"remote_checked{label}"] = getter.stats()["counters"].get("remote_fetched_blocks", 0)
            getter.close()
            getter = None
        client.close()
        arena.close()
        return figures
    finally:
        if getter is not None:
            getter.close()
        holder.stdin.close()
        holder.wait(30)


# --- Mooncake Store -----------------------------------------------------------------------
def peer_python(venv: str | None) -> Path:
    from benchmarks.peers.venv import PEER_VENV, ensure_peer_venv

    if venv is None and not (PEER_VENV / ".complete").exists():
        main_venv = REPO.parent / "main" / ".venvs" / "peer-mooncake-te"  # a worktree shares main's
        venv = str(main_venv) if (main_venv / ".complete").exists() else None
    return ensure_peer_venv(Path(venv) if venv else PEER_VENV)


def mooncake_store(python: Path, block_bytes: int, count: int) -> dict:
    client = str(REPO / "benchmarks" / "peers" / "mooncake_store_client.py")
    rpc, http, metrics = free_port(), free_port(), free_port()
    master_bin = python.parent / "mooncake_master"
    log = open(os.devnull, "w")
    master = subprocess.Popen([str(master_bin), f"-rpc_port={rpc}", "-enable_http_metadata_server=true",
                               f"-http_metadata_server_port={http}", "-http_metadata_server_host=127.0.0.1",
                               f"-metrics_port={metrics}", "-metrics_host=127.0.0.1"], stdout=log, stderr=log)
    holder = None
    try:
        time.sleep(1.0)
        addr, meta = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
        run = [str(python), client]
        local = subprocess.run([*run, "local", addr, meta, str(block_bytes), str(count), str(BATCH)],
                               capture_output=True, text=True, timeout=600, cwd="/")
        if local.returncode:
            raise RuntimeError(f"Mooncake Store local run failed: {local.stderr[-2000:]}")
        figures = json.loads(local.stdout.strip().splitlines()[-1])
        holder = subprocess.Popen([*run, "holder", addr, meta, str(block_bytes), str(count)], cwd="/",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        if not holder.stdout.readline():
            raise RuntimeError("Mooncake Store holder did not start")
        remote = subprocess.run([*run, "getter", addr, meta, str(block_bytes), str(count), str(BATCH)],
                                capture_output=True, text=True, timeout=600, cwd="/")
        if remote.returncode:
            raise RuntimeError(f"Mooncake Store remote run failed: {remote.stderr[-2000:]}")
        got = json.loads(remote.stdout.strip().splitlines()[-1])
        figures.update(remote_get=got["get"], remote_batch_get=got["batch_get"], remote_put=got["put"])
        return figures
    finally:
        if holder is not None:
            holder.stdin.close()
            try:
                holder.wait(20)
            except subprocess.TimeoutExpired:
                holder.kill()
        master.terminate()
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
        log.close()


# --- the index alone ------------------------------------------------------------------------
def index_comparison(quick: bool) -> dict:
    """Requests of 16 keys over 2,000 shared prefixes, 4,096 blocks of room: look the keys up,
    pin and unpin the leading hits, store the misses (evicting). Process CPU time (the machine
    is shared; CPU time is what the index costs whatever else runs)."""
    import random

    from store.config import PoolConfig
    from store.pool import BlockPool

    capacity, length, n = 4096, 16, 1000 if quick else 4000
    rng = random.Random(0)
    requests = [[rng.randrange(2000) * 1000 + j for j in range(length)] for _ in range(n)]

    def ours_run() -> float:
        pool = BlockPool(PoolConfig(dram_bytes=capacity * KIB, ssd_dir=None, block_bytes=KIB))
        started = time.process_time()
        for i, keys in enumerate(requests):
            hits = len(pool.lookup(keys))
            pinned = [k for k in keys[:hits] if pool.read(k, i) is not None]
            pool.unpin(pinned)
            stored = [k for k, _ in pool.reserve(keys[hits:], i).slots]
            pool.commit(stored, [0] * len(stored), i)
            pool.drain_events()
        return time.process_time() - started

    def vllm_run() -> float:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        manager = CPUOffloadingManager(capacity, "lru", enable_events=True)
        started = time.process_time()
        for i, keys in enumerate(requests):
            context = ReqContext(str(i))
            offload_keys = [k.to_bytes(16, "big") + b"\0\0\0\0" for k in keys]  # its key: hash + group
            hits = 0
            for key in offload_keys:
                if manager.lookup(key, context) is not LookupResult.HIT:
                    break
                hits += 1
            if hits:
                manager.prepare_load(offload_keys[:hits], context)
                manager.complete_load(offload_keys[:hits], context)
            out = manager.prepare_store(offload_keys[hits:], context)
            if out is not None:
                manager.complete_store(out.keys_to_store, context)
            list(manager.take_events())
        return time.process_time() - started

    try:
        vllm_run()  # imports and warms up
    except ImportError as exc:
        return {"error": f"vLLM's offloading is not importable: {exc}"}
    ours_s = min(ours_run() for _ in range(3))
    vllm_s = min(vllm_run() for _ in range(3))
    return {"requests": n, "keys_per_request": length, "capacity_blocks": capacity,
            "ours_requests_per_cpu_s": n / ours_s, "vllm_requests_per_cpu_s": n / vllm_s, "ratio": vllm_s / ours_s}


# --- the SSD tier's files alone ---------------------------------------------------------------
def ssd_comparison(block_bytes: int, count: int, directory: str) -> dict:
    """Write then read `count` blocks: our SsdTier (header, checksum verified on every read)
    against the file I/O of vLLM's own file-system tier (vllm.v1.kv_offload.tiering.fs.io: the
    same write-and-rename and readv, no header, no checksum), buffered I/O for both. Wall time;
    the page cache serves the reads of both alike."""
    import shutil
    import tempfile

    from store.pool import checksum
    from store.ssd import SsdTier

    blocks = np.random.default_rng(1).integers(0, 256, (4, block_bytes), dtype=np.uint8)
    out = np.ones(block_bytes, dtype=np.uint8)
    digests = [checksum(b) for b in blocks]
    figures = {}
    root = tempfile.mkdtemp(prefix="store-bench-ssd-", dir=directory)
    try:
        tier = SsdTier(os.path.join(root, "ours"), LAYOUT, block_bytes)
        tier.open()
        started = time.perf_counter()
        for i in range(count):
            tier.write(i, blocks[i % 4], digests[i % 4])
        figures["ours_write"] = rate(count, count * block_bytes, time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(count):
            if not tier.read_into(i, out, digests[i % 4]):
                raise SystemExit("our SSD tier lost a block")
        figures["ours_read"] = rate(count, count * block_bytes, time.perf_counter() - started)
        try:
            from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block
        except ImportError as exc:
            figures["vllm_error"] = str(exc)
            return figures
        theirs = os.path.join(root, "vllm")
        paths = [os.path.join(theirs, f"{i // 256:03x}", f"{i:032x}.bin") for i in range(count)]
        src = memoryview(blocks.reshape(-1))
        started = time.perf_counter()
        for i, path in enumerate(paths):
            batch_store_block([path], src, [(i % 4) * block_bytes], block_bytes, use_o_direct=False)
        figures["vllm_write"] = rate(count, count * block_bytes, time.perf_counter() - started)
        dst = memoryview(out)
        started = time.perf_counter()
        for path in paths:
            batch_load_block([path], dst, [0], block_bytes, use_o_direct=False)
        figures["vllm_read"] = rate(count, count * block_bytes, time.perf_counter() - started)
        return figures
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- report --------------------------------------------------------------------------------
ROWS = [("put", "put (local)"), ("get", "get (local)"), ("batch_get", f"batch get x{BATCH} (local)"),
        ("remote_put", "put (remote)"), ("remote_get", "get (remote, tcp)"),
        ("remote_batch_get", f"batch get x{BATCH} (remote, tcp)"),
        ("remote_get_auto", "get (remote, same host: engine's choice)"),
        ("remote_batch_get_auto", f"batch get x{BATCH} (remote, same host: engine's choice)"),
        ("remote_get_arena", "get (remote, same host: engine's choice)"),
        ("remote_batch_get_arena", f"batch get x{BATCH} (remote, same host: engine's choice)")]


def _theirs_key(key: str) -> str:
    """Our remote rows all compare with Mooncake Store's one remote row."""
    for suffix in REMOTE_SUFFIXES:
        if suffix and key.endswith(suffix):
            return key.removesuffix(suffix)
    return key


def human(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def report(results: dict) -> str:
    lines = []
    for block_bytes, figures in results["sizes"].items():
        ours_f, peer_f = figures["ours"], figures.get("mooncake_store")
        lines.append(f"\n### {human(int(block_bytes))} blocks ({ours_f['put']['ops']} ops)\n")
        lines.append("| operation | ours ops/s | ours GB/s | Mooncake Store ops/s | Mooncake Store GB/s | ours / theirs |")
        lines.append("|---|---:|---:|---:|---:|---:|")
        for key, label in ROWS:
            mine = ours_f.get(key)
            theirs = (peer_f or {}).get(_theirs_key(key))
            if mine and "transport" in mine:
                label = label.replace("engine's choice", mine["transport"])
            cells = [f"{mine['ops_per_s']:,.0f}", f"{mine['gb_per_s']:.2f}"] if mine else ["n/a", "n/a"]
            cells += [f"{theirs['ops_per_s']:,.0f}", f"{theirs['gb_per_s']:.2f}"] if theirs else ["-", "-"]
            ratio = f"{mine['ops_per_s'] / theirs['ops_per_s']:.2f}x" if mine and theirs else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")
        goal = GOALS.get(int(block_bytes))
        if peer_f and goal:
            for key in (f"remote_{what}{suffix}" for suffix in REMOTE_SUFFIXES for what in ("get", "batch_get")):
                if key not in ours_f:
                    continue
                r = ours_f[key]["ops_per_s"] / peer_f[_theirs_key(key)]["ops_per_s"]
                lines.append(f"\nGoal {_theirs_key(key).replace('_', ' ')} >= {goal}x Mooncake Store, ours "
                             f"over {ours_f[key]['transport']}: {r:.2f}x ({'met' if r >= goal else 'NOT met'})")
    for block_bytes, ssd in results.get("ssd", {}).items():
        if "vllm_read" in ssd:
            lines.append(f"\nSSD tier files, {human(int(block_bytes))} blocks ({ssd['ours_write']['ops']}): write ours "
                         f"{ssd['ours_write']['gb_per_s']:.2f} GB/s, vLLM's fs tier {ssd['vllm_write']['gb_per_s']:.2f}; "
                         f"read (ours verifying each checksum) {ssd['ours_read']['gb_per_s']:.2f} GB/s, vLLM's "
                         f"{ssd['vllm_read']['gb_per_s']:.2f}")
    index = results.get("index")
    if index and "ratio" in index:
        lines.append(f"\nIndex alone ({index['requests']} requests of {index['keys_per_request']} keys, "
                     f"{index['capacity_blocks']} blocks): ours {index['ours_requests_per_cpu_s']:,.0f} requests per "
                     f"CPU second, vLLM's CPUOffloadingManager {index['vllm_requests_per_cpu_s']:,.0f} "
                     f"(ours {index['ratio']:.2f}x)")
    elif index:
        lines.append(f"\nIndex comparison skipped: {index['error']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    results: dict = {"quick": args.quick, "sizes": {}}
    python = None if args.no_peer else peer_python(args.peer_venv)
    for block_bytes in (size(s) for s in args.sizes.split(",")):
        count = counts(block_bytes, args.quick)
        figures = {"ours": ours(block_bytes, count)}
        if python is not None:
            figures["mooncake_store"] = mooncake_store(python, block_bytes, count)
        results["sizes"][str(block_bytes)] = figures
    if not args.no_index:
        results["index"] = index_comparison(args.quick)
        results["ssd"] = {str(b): ssd_comparison(b, counts(b, args.quick), args.ssd_dir)
                          for b in (size(s) for s in args.sizes.split(","))}
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return
    results = run(args)
    text = report(results)
    print(text)
    if args.results_md:
        from benchmarks.results_md import write_block

        command = "python -m benchmarks.store_bench" + (" --quick" if args.quick else "")
        write_block("store-bench", f"Tables printed by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}):\n{text}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
