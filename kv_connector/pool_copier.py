"""The pool connector's worker half, in vLLM's worker: copies between the paged KV cache and the
pool's shared-memory arena.

The arena is the pool's DRAM tier, a shared-memory segment of `slots` blocks, each block all
layers of one KV block laid end to end in the engine's layer order (`ArenaLayout`); the worker
maps it once, so a copy is one index_select/index_copy_ per layer, never a socket.

- Synchronous loads (a DRAM hit): start_load_kv hands the step's loads to a copy thread that
  copies layer 0, then 1, ...; wait_for_layer_load(layer) waits for that layer only, so the copy
  of layer i+1 runs while layer i computes. The blocks are unpinned once copied. Each block's
  bytes are hashed as they are copied (xxh3-64, layer by layer); one that does not match the
  checksum it was committed with is reported with the last layer (vLLM recomputes it) and the
  pool forgets it.
- Asynchronous loads (a hit with SSD blocks): a thread asks the pool to bring the blocks to DRAM
  (it reads the files and checks each block's checksum), copies them in, unpins them, and the
  request is reported finished receiving; a block the pool cannot read (corrupt, gone) fails the
  load and vLLM recomputes the prompt (kv_load_failure_policy="recompute").
- Saves: save_kv_layer queues the copy of that layer's new blocks into their reserved slots on a
  save thread and returns; after a save's last layer the thread commits its keys. A finished
  request with saves in flight is reported finished sending only once they are copied (vLLM
  keeps its blocks until then); a preempted one's saves are finished before the next step can
  overwrite its freed blocks (handle_preemptions).
- On CUDA both directions go through pinned host memory (the bus's speed, 6-8x pageable memory's
  on an H200, benchmarks/RESULTS.md). A save first waits, on its thread, for an event recorded on
  the forward's stream when the layer was saved, so it never reads KV the GPU has not written yet;
  a load's layer is released to the forward only once its copy has run on the device. Each
  layer's copy between the arena and the pinned rows is shared among ARENA_COPY_THREADS threads.
"""

from __future__ import annotations

import logging
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kv_connector.pool_checksums import BlockReads, SaveJob
from kv_connector.pool_planner import PoolLoad, PoolSave
from messenger.cma import in_parallel
from mooncake.kv_layout import block_bytes, blocks_first, runs
from store.arena import Arena
from store.channel import PoolClient, PoolUnavailable

log = logging.getLogger("vllm.mooncake." + __name__)

POISON_STEPS = 3
"""Steps after a pool load failed in which new saves over the failed blocks still abort. With
async scheduling (vLLM's default on GPU) the next step is planned, its saves included, before
the failed step's invalid blocks reach the scheduler, and its forward computes over the bad
block; a save spoiled for a reused block id is only a cache miss."""
ARENA_COPY_THREADS = 4
"""Threads sharing one layer's copy between the arena and host rows, when the caches are on a GPU:
one thread's memcpy (9-11 GB/s on the H200 machine) is far below a GPU node's memory bandwidth,
and on the critical path of a load. With host caches one thread copies: the engine's own
threads compute on the same cores."""


@dataclass(frozen=True)
class ArenaLayout:
    """Where each layer of a block lives inside an arena slot."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # bytes of one block of the layer
    block_bytes: int

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor]) -> "ArenaLayout":
        names, offsets, sizes, offset = [], [], [], 0
        for name, cache in kv_caches.items():  # blocks-first views (mooncake/kv_layout.py)
            size = block_bytes(cache)
            names.append(name)
            offsets.append(offset)
            sizes.append(size)
            offset += size
        return cls(tuple(names), tuple(offsets), tuple(sizes), offset)

    def describe(self, kv_caches: dict[str, torch.Tensor], block_size: int, model_id: str = "") -> str:
        """What the pool records with its blocks (the SSD tier keeps it across restarts), so blocks
        written by an engine of another model, dtype or block size are never read into this one.
        model_id: the weights (kv_connector/model_identity.py); the shapes alone are the same for
        a model and its fine-tune."""
        return json.dumps({"model": model_id, "block_size": block_size, "layers": [
            [n, list(kv_caches[n].shape[1:]), str(kv_caches[n].dtype).removeprefix("torch.")] for n in self.names]})


@dataclass
class CopierStats:
    loaded_blocks: int = 0
    load_seconds: float = 0.0
    load_failures: int = 0
    fetched_blocks: int = 0
    saved_blocks: int = 0
    save_seconds: float = 0.0
    save_failures: int = 0


@dataclass
class _StepLoads:
    """The synchronous loads of one step and how far the copy thread got."""

    loads: list[PoolLoad]
    layers_done: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    waited: int = 0  # layers the forward pass has already waited for
    failed_blocks: set[int] = field(default_factory=set)


class PoolCopier:
    def __init__(self, connect: Callable[[float], PoolClient], block_size: int, timeout_s: float = 2.0,
                 load_timeout_s: float = 30.0, model_id: str = ""):
        """model_id: which weights the engine runs (model_identity.py), recorded with its blocks."""
        # One line to the pool per thread: pins belong to the line that read them, and a slow SSD
        # read on one must not hold up the step's synchronous loads or the saves' commits.
        self._client = connect(timeout_s)  # set-up and the save thread's commits
        self._sync_client = connect(timeout_s)  # this step's DRAM reads (on the critical path)
        self._async_client = connect(load_timeout_s)  # reads that go to SSD
        self._block_size = block_size
        self._model_id = model_id
        self._load_timeout_s = load_timeout_s
        self._caches: dict[str, torch.Tensor] = {}
        self._layout: ArenaLayout | None = None
        self._mapping: Arena | None = None
        self._arena: torch.Tensor | None = None
        self._arena_bytes = None  # the same memory as numpy (slots x block bytes), for memcpys
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-load")
        self._async_loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-fetch")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-save")
        self._arena_copiers: ThreadPoolExecutor | None = None  # ARENA_COPY_THREADS - 1 helpers (GPU caches)
        self._step: _StepLoads | None = None
        self._layer_of: dict[str, int] = {}
        self._async: dict[str, Future] = {}  # request id -> its asynchronous load
        self._lock = threading.Condition()
        self._jobs: dict[PoolSave, SaveJob] = {}
        self._saves_left: dict[str, int] = {}  # request id -> its saves not yet committed
        self._has_saves: set[str] = set()  # requests vLLM must hear "finished sending" about
        self._finished: set[str] = set()  # finished by vLLM, saves maybe still in flight
        self._invalid_blocks: set[int] = set()
        self._poisoned: set[int] = set()  # blocks whose load failed in the last POISON_STEPS steps
        self._poison_steps = 0
        self._said_unhashed = False
        self.stats = CopierStats()

    # -- set-up ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        """`num_blocks`: blocks per layer, which tells where the blocks are (mooncake/kv_layout.py)."""
        self._caches = {name: blocks_first(cache, num_blocks) for name, cache in kv_caches.items()}
        self._layout = ArenaLayout.of(self._caches)
        self._layer_of = {name: i for i, name in enumerate(self._layout.names)}
        try:
            info = self._client.configure(self._layout.block_bytes,
                                          self._layout.describe(self._caches, self._block_size, self._model_id),
                                          timeout_s=self._load_timeout_s)
            self._mapping = Arena.attach(info)
        except (PoolUnavailable, OSError, ValueError) as exc:
            # No arena (shared memory full, a pool of another layout...): the engine runs without
            # the pool rather than not at all. Loads fail (vLLM recomputes); saves are given back.
            log.error("KVCache pool unavailable, running without it: %s", exc)
            return
        self._arena = torch.from_numpy(self._mapping.array).view(info.slots, info.block_bytes)
        self._arena_bytes = self._arena.numpy()
        if any(cache.is_cuda for cache in self._caches.values()) and ARENA_COPY_THREADS > 1:
            self._arena_copiers = ThreadPoolExecutor(ARENA_COPY_THREADS - 1, thread_name_prefix="pool-copy")
        log.info("KVCache pool: %d arena slots of %d B mapped from %s", info.slots, info.block_bytes, info.path)

    def shutdown(self) -> None:
        for pool in (self._loader, self._async_loader, self._saver, self._arena_copiers):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        for client in (self._client, self._sync_client, self._async_client):
            client.close()

    # -- loads ----------------------------------------------------------------------------

    def start_loads(self, loads: list[PoolLoad]) -> None:
        """Called once per step (vLLM's start_load_kv), before its layers."""
        with self._lock:
            if self._poison_steps:
                self._poison_steps -= 1
                if not self._poison_steps:
                    self._poisoned = set()
        if self._arena is None and loads:  # no arena mapped: nothing can be loaded, vLLM recomputes
            self._invalid_blocks.update(b for load in loads if load.sync for b in load.block_ids)
            loads = [load for load in loads if not load.sync]
        for load in loads:
            if not load.sync:
                self._async[load.request_id] = self._async_loader.submit(self._load_async, load)
        sync = [load for load in loads if load.sync]
        if sync:
            step = _StepLoads(sync)
            self._step = step
            self._loader.submit(self._load_layers, step)

    def wait_for_layer(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        index = self._layer_of[layer_name]
        while step.waited <= index:  # the copy thread releases one per layer, in order
            if not step.layers_done.acquire(timeout=self._load_timeout_s):
                raise TimeoutError(f"pool load of layer {layer_name} did not finish in {self._load_timeout_s} s")
            step.waited += 1
        if step.waited == len(self._layer_of):
            self._step = None
            # Blocks that could not be read: vLLM recomputes them (reported in this same step).
            self._invalid_blocks |= step.failed_blocks
            # This step computed those requests' other blocks over the bad KV: their saves must not
            # commit (each job's commit waits for its last layer, saved after this wait returns).
            # Nor may any other request's whose blocks include a failed one: vLLM's prefix cache
            # shares a block loaded for one request with the requests admitted after it.
            failed = {load.request_id for load in step.loads if step.failed_blocks.intersection(load.block_ids)}
            if step.failed_blocks:
                self._spoil_saves(failed, "computed over blocks that failed to load", step.failed_blocks)
                with self._lock:  # and the saves of the steps planned before vLLM hears of it
                    self._poisoned |= step.failed_blocks
                    self._poison_steps = POISON_STEPS + 1  # (this step's own start_loads is past)

    def _load_layers(self, step: _StepLoads) -> None:
        """The copy thread of one step's synchronous loads: pin and locate the blocks, then copy
        layer after layer, releasing the forward pass one layer at a time."""
        start = time.perf_counter()
        assert self._layout is not None
        plans: list[BlockReads] = []
        try:
            for load in step.loads:
                got = self._sync_client.read(load.keys)  # pinned on this line; SSD blocks promoted
                plans.append(BlockReads(load, got))
                step.failed_blocks.update(load.block_ids[len(got):])
        except Exception as exc:  # noqa: BLE001 - nothing read: vLLM recomputes these blocks
            log.warning("pool read failed (%s); recomputing %d requests' prefixes", exc, len(step.loads))
            step.failed_blocks.update(b for load in step.loads for b in load.block_ids)
        last = len(self._layout.names) - 1
        for index, name in enumerate(self._layout.names):
            try:
                for read in plans:
                    if read.keys:
                        self._copy_in(name, index, read.block_ids, read.slots, read.digests)
                if index == last:  # every byte copied in is checked before the forward uses the last layer
                    for read in plans:
                        step.failed_blocks.update(read.block_ids[i] for i in read.corrupt())
            except Exception as exc:  # noqa: BLE001 - reported as invalid blocks: vLLM recomputes them
                log.exception("pool load failed on layer %s: %s", name, exc)
                step.failed_blocks.update(b for read in plans for b in read.block_ids)
                for read in plans:
                    self._release(self._sync_client, read.keys)
                plans = []
            step.layers_done.release()
        for read in plans:
            self._release(self._sync_client, read.keys)
            self._discard(self._sync_client, [read.keys[i] for i in read.corrupt()])
        with self._lock:
            self.stats.loaded_blocks += sum(len(read.keys) for read in plans)
            self.stats.load_failures += len(step.failed_blocks)
            self.stats.load_seconds += time.perf_counter() - start

    def _load_async(self, load: PoolLoad) -> None:
        """A load with SSD blocks, or from another node's pool: the pool brings them into its DRAM
        (from the other pool through the messenger; reading files, checking each checksum), then
        they are copied in whole and stay in this pool. Any block missing fails the load: vLLM
        recomputes the prompt."""
        start = time.perf_counter()
        assert self._layout is not None
        if load.peer is not None:  # Algorithm 1's fetch_from: the blocks come from another node's pool
            held = self._async_client.fetch_remote(load.peer.encode(), load.keys)
            with self._lock:
                self.stats.fetched_blocks += held
        read = BlockReads(load, self._async_client.read(load.keys))
        corrupt: list[int] = []
        try:
            if len(read.keys) < len(load.keys):
                raise LookupError(f"the pool could read {len(read.keys)} of {len(load.keys)} blocks (evicted or corrupt)")
            for index, name in enumerate(self._layout.names):
                self._copy_in(name, index, read.block_ids, read.slots, read.digests)
            corrupt = read.corrupt()
            if corrupt:
                raise LookupError(f"{len(corrupt)} of {len(read.keys)} blocks failed their checksum in DRAM")
        finally:
            self._release(self._async_client, read.keys)
            self._discard(self._async_client, [read.keys[i] for i in corrupt])
        keys = read.keys
        with self._lock:
            self.stats.loaded_blocks += len(keys)
            self.stats.load_seconds += time.perf_counter() - start

    def _copy_in(self, name: str, index: int, block_ids, slots, digests=None) -> None:
        """Copy layer `index` of the slots into the cache's blocks; `digests`: one running xxh3
        per block, fed the bytes copied (layers in slot order make the block's checksum)."""
        assert self._layout is not None and self._arena is not None
        cache = self._caches[name]
        shape = (len(block_ids), *cache.shape[1:])
        rows = torch.empty((len(block_ids), self._layout.sizes[index]), dtype=torch.uint8, pin_memory=cache.is_cuda)
        self._arena_rows(index, slots, rows.numpy(), into_arena=False)
        if digests is not None:
            flat = rows.numpy()
            for digest, row in zip(digests, flat):
                digest.update(row)
        if not cache.is_cuda:
            cache.index_copy_(0, torch.tensor(block_ids, dtype=torch.long), rows.view(cache.dtype).view(shape))
            return
        on_device = rows.to(cache.device, non_blocking=True).view(cache.dtype).view(shape)
        cache.index_copy_(0, torch.tensor(block_ids, dtype=torch.long).to(cache.device), on_device)
        torch.cuda.current_stream(cache.device).synchronize()  # in the cache before the forward reads it

    def _arena_rows(self, index: int, slots, rows, into_arena: bool) -> None:
        """Copy one layer's part of each slot to (or from) `rows`, one numpy copy per run of
        adjacent slots: plain memcpys (torch's index_select / index_copy_ on the arena's strided
        byte view ran at 1.4-2.6 GB/s on the H200 machine, memcpy at 10). With GPU caches the
        runs are shared among ARENA_COPY_THREADS threads (numpy copies without the GIL)."""
        assert self._layout is not None and self._arena is not None
        begin = self._layout.offsets[index]
        layer = self._arena_bytes[:, begin:begin + self._layout.sizes[index]]

        def copy(spans) -> None:
            for position, slot, count in spans:
                if into_arena:
                    layer[slot:slot + count] = rows[position:position + count]
                else:
                    rows[position:position + count] = layer[slot:slot + count]

        # The messenger's even cut of copies among threads, in rows here (a run's triples advance
        # the same way as its copies'); without helpers (host caches) all in this thread.
        in_parallel(copy, runs(slots), pool=self._arena_copiers, threads=ARENA_COPY_THREADS, parallel_min_bytes=2)

    def collect_loads(self) -> tuple[set[str], set[str]]:
        """(finished, failed) asynchronous loads; failed ones are also finished, as vLLM wants."""
        finished, failed = set(), set()
        for req_id, future in list(self._async.items()):
            if not future.done():
                continue
            del self._async[req_id]
            finished.add(req_id)
            if future.exception() is not None:
                log.warning("pool load for %s failed (%s); recomputing its prompt", req_id, future.exception())
                failed.add(req_id)
                with self._lock:
                    self.stats.load_failures += 1
        return finished, failed

    def take_invalid_blocks(self) -> set[int]:
        blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    # -- saves ----------------------------------------------------------------------------

    def save_layer(self, saves: list[PoolSave], layer_name: str) -> None:
        if not saves:
            return
        if self._arena is None:  # no arena mapped here: the planner's reservations are given back
            if self._layer_of.get(layer_name) == 0:
                self._drop_saves(saves)
            return
        index = self._layer_of[layer_name]
        written = None
        if self._caches[layer_name].is_cuda:  # the layer's KV is written once the forward's stream gets here
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self._caches[layer_name].device))
        with self._lock:
            for save in saves:
                if save not in self._jobs:  # its first layer
                    self._has_saves.add(save.request_id)
                    self._saves_left[save.request_id] = self._saves_left.get(save.request_id, 0) + 1
                    job = self._jobs[save] = SaveJob(len(self._layer_of), len(save.keys))
                    if not self._poisoned.isdisjoint(save.prefix_ids or save.block_ids):
                        job.ok = False  # computed over a block whose load failed a step or two ago
                        log.warning("pool save of %s will not commit: computed over blocks that failed to load",
                                    save.request_id)
        for save in saves:
            self._saver.submit(self._save_layer, save, layer_name, index, written)

    def _save_layer(self, save: PoolSave, name: str, index: int, written=None) -> None:
        start = time.perf_counter()
        ok = True
        with self._lock:
            job = self._jobs[save]
        try:
            assert self._layout is not None and self._arena is not None
            cache = self._caches[name]
            ids = torch.tensor(save.block_ids, dtype=torch.long, device=cache.device)
            if written is not None:
                written.synchronize()
                rows = torch.empty((len(save.block_ids), *cache.shape[1:]), dtype=cache.dtype, pin_memory=True)
                rows.copy_(cache.index_select(0, ids), non_blocking=True)
                torch.cuda.current_stream(cache.device).synchronize()
            else:
                rows = cache.index_select(0, ids)
            flat = rows.reshape(len(save.block_ids), -1).view(torch.uint8).numpy()
            self._arena_rows(index, save.slots, flat, into_arena=True)
            job.hash_layer(index, flat)  # one save thread: a save's layers come one at a time, in order
            if job.digests is None and not self._said_unhashed:
                self._said_unhashed = True
                log.info("pool saves: layers come out of the arena's order; the pool hashes the slots at commit")
        except Exception as exc:  # noqa: BLE001 - a failed save is a future cache miss, never wrong KV
            log.exception("pool save of layer %s failed: %s", name, exc)
            ok = False
        with self._lock:
            self.stats.save_seconds += time.perf_counter() - start
            job.layers_left -= 1
            job.ok = job.ok and ok
            if job.layers_left > 0:
                return
            del self._jobs[save]
        # The last layer is in: the keys become readable (commit) or are given back (abort).
        try:
            if job.ok:
                self._client.commit(save.keys, job.checksums())
            else:
                self._client.abort(save.keys)
        except PoolUnavailable as exc:
            log.warning("pool %s failed: %s", "commit" if job.ok else "abort", exc)
        with self._lock:
            if job.ok:
                self.stats.saved_blocks += len(save.keys)
            else:
                self.stats.save_failures += 1
            self._saves_left[save.request_id] = self._saves_left.get(save.request_id, 0) - 1
            self._lock.notify_all()

    def _drop_saves(self, saves: list[PoolSave]) -> None:
        """Saves this worker cannot copy (called at their first layer): abort their slots, and
        still report the request finished sending when vLLM finishes it (the planner asked vLLM
        to keep its blocks for them)."""
        with self._lock:
            self._has_saves.update(save.request_id for save in saves)
        for save in saves:
            try:
                self._client.abort(save.keys)
            except PoolUnavailable as exc:  # the pool's reservation lease frees them in the end
                log.warning("pool abort failed: %s", exc)

    def flush(self, request_ids) -> None:
        """Wait until the saves of these requests are copied (their blocks are about to be reused).
        Those not copied in time abort instead of committing: they would copy other requests' KV."""
        with self._lock:
            copied = self._lock.wait_for(lambda: all(self._saves_left.get(r, 0) <= 0 for r in request_ids),
                                         timeout=self._load_timeout_s)
        if not copied:
            self._spoil_saves(set(request_ids), f"not copied within {self._load_timeout_s:g} s before the "
                                                "blocks were reused")

    def _spoil_saves(self, request_ids: set[str], why: str, blocks: set[int] = frozenset()) -> None:
        """The pending saves of these requests, and those over any of `blocks`, abort instead of
        committing (their bytes are wrong)."""
        with self._lock:
            spoiled = {save.request_id: job for save, job in self._jobs.items()
                       if save.request_id in request_ids or not blocks.isdisjoint(save.prefix_ids or save.block_ids)}
            for job in spoiled.values():
                job.ok = False
        if spoiled:
            log.warning("pool saves of %s will not commit: %s", sorted(spoiled), why)

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves are all copied: it may free their blocks now."""
        with self._lock:
            self._finished |= finished_req_ids & self._has_saves
            done = {r for r in self._finished if self._saves_left.get(r, 0) <= 0}
            self._finished -= done
            self._has_saves -= done
            for r in done:
                self._saves_left.pop(r, None)
        return done

    def stats_dict(self) -> dict:
        with self._lock:
            return asdict(self.stats)

    @staticmethod
    def _discard(client: PoolClient, keys) -> None:
        if not keys:
            return
        log.warning("%d pool block(s) failed their checksum; vLLM recomputes them", len(keys))
        try:
            client.discard(list(keys))
        except PoolUnavailable as exc:
            log.warning("pool discard failed: %s", exc)

    @staticmethod
    def _release(client: PoolClient, keys) -> None:
        if not keys:
            return
        try:
            client.release(list(keys))
        except PoolUnavailable as exc:  # the pool's pin lease frees them in the end
            log.warning("pool release failed: %s", exc)
