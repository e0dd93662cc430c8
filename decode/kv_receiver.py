"""The consumer's data path, in vLLM's worker process: receive pushed KV and land it in the
paged cache.

Pushed bytes land in the staging arena (decode/staging.py), which is registered with the transfer
engine: the prefill reserves a transfer's room with one `engine.call` (answered by `_on_call`,
which checks the layout first), then writes each layer's blocks there; the engine verifies every
slice's checksum before the layer's note reaches `_on_notify`. No buffer is allocated or zeroed
per frame. Each engine step, `collect_loads` copies complete transfers from the arena into the
blocks the scheduler allocated and reports them finished; a transfer that is broken or late, or
that lacks blocks this worker no longer holds, is reported failed, and vLLM recomputes that
prompt locally (kv_load_failure_policy="recompute"): slower, never wrong.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

import msgspec
import numpy as np
import torch

from decode.load_planner import LoadSpec
from decode.staging import KVStaging, StagedTransfer, StagingConfig
from messenger.api import NotifyRefused
from mooncake.kv_layout import block_bytes, blocks_first, direct, runs
from mooncake.protocol import (KV_CALL_DECODER, KV_CALL_ENCODER, KV_NOTE_DECODER, KVHello, KVReserve,
                               KVReserved)

# Under "vllm." so the messages show in vLLM's worker processes, whose logging vLLM configures.
log = logging.getLogger("vllm.mooncake." + __name__)

STAGING_REGION = "kv-staging"


@dataclass
class ReceiverStats:
    """Counters since start; served through the connector's control channel."""

    loaded_transfers: int = 0
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    loaded_blocks: int = 0  # block rows of one layer each, summed over layers
    received_blocks: int = 0  # the same, as they landed in staging
    load_failures: int = 0
    load_timeouts: int = 0
    checksum_failures: int = 0
    load_seconds: float = 0.0  # copying staged blocks into the paged cache


@dataclass
class _PendingLoad:
    spec: LoadSpec
    deadline: float


class KVReceiver:
    def __init__(self, engine, block_size: int, staging: StagingConfig):
        """`engine`: a messenger TransferEngine, not started yet (the connector starts it with
        this receiver's handlers once the caches are registered)."""
        self._engine = engine
        self._block_size = block_size
        self._staging = KVStaging(staging)
        self._pin_for_cuda = staging.pin_for_cuda
        self._arena = np.empty(staging.capacity_bytes, dtype=np.uint8)  # allocated once, never zeroed
        self._engine.register(STAGING_REGION, self._arena)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layout: list[tuple[str, str, list[int]]] = []
        self._pending: dict[str, _PendingLoad] = {}
        self._stats = ReceiverStats()
        self._stats_lock = threading.Lock()
        self._pinned = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        """`num_blocks`: blocks per layer, which tells the block dim (mooncake/kv_layout.py)."""
        self._kv_caches = {name: blocks_first(c, num_blocks) for name, c in kv_caches.items()}
        self._layer_index = {name: i for i, name in enumerate(self._kv_caches)}
        self._layout = [(name, str(c.dtype).removeprefix("torch."), list(c.shape[1:]))
                        for name, c in self._kv_caches.items()]
        # Host caches as flat bytes: landing is a memcpy per run of adjacent blocks (numpy's copy is
        # one plain memcpy; torch's parallel copy_ stalls when its threads find the cores busy).
        self._cache_bytes = {name: c.view(torch.uint8).view(-1).numpy() for name, c in self._kv_caches.items()
                             if direct(c)}
        devices = {c.device for c in self._kv_caches.values() if c.device.type == "cuda"}
        if devices and self._pin_for_cuda:
            self._pin_arena()

    def _pin_arena(self) -> None:
        """Page-lock the arena, so landing on a GPU is one DMA per layer instead of the driver's
        copy through its own pinned bounce buffer (benchmarks/kv_path_cuda.py measures both)."""
        start = time.perf_counter()
        error = torch.cuda.cudart().cudaHostRegister(self._arena.ctypes.data, self._arena.nbytes, 0)
        if int(error) != 0:
            log.warning("could not pin the %d MiB staging arena (CUDA error %s); landing copies go "
                        "through pageable memory", self._arena.nbytes >> 20, error)
            return
        self._pinned = True
        log.info("pinned the %d MiB staging arena in %.2f s", self._arena.nbytes >> 20, time.perf_counter() - start)

    @property
    def arena_pinned(self) -> bool:
        """Whether the staging arena is page-locked (caches on a GPU, pin_for_cuda)."""
        return self._pinned

    def shutdown(self) -> None:
        """Unpin the arena (if pinned); the engine that registered it is closed by its owner."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._arena.ctypes.data)
            self._pinned = False

    def stats(self) -> dict:
        with self._stats_lock:
            return {**asdict(self._stats), "staged_bytes": self._staging.used_bytes}

    def drop(self, transfer_id: str) -> None:
        """The conductor will not decode this transfer here: free what was staged for it (a
        transfer being landed right now keeps its slot until the landing ends)."""
        self._staging.pop(transfer_id, time.monotonic())

    # -- receiving (the engine's threads) ----------------------------------------------------

    def on_call(self, peer: str, request: bytes) -> bytes:
        message = KV_CALL_DECODER.decode(request)
        if isinstance(message, KVHello):
            return msgspec.json.encode(self._engine.info())
        return KV_CALL_ENCODER.encode(self._reserve(message))

    def _reserve(self, request: KVReserve) -> KVReserved:
        layout = [(name, dtype, list(shape)) for name, dtype, shape in request.layers]
        if layout != self._layout:
            mismatch = next(((a, b) for a, b in zip(layout, self._layout) if a != b), None)
            return KVReserved(error=f"incompatible KV layout: sender has {len(layout)} layers, this engine "
                                    f"{len(self._layout)}; first difference {mismatch}")
        sizes = {block_bytes(self._kv_caches[name]) for name, _, _ in layout}
        if sizes != {request.block_bytes}:
            return KVReserved(error=f"block of {request.block_bytes} B, this engine's are {sorted(sizes)} B")
        try:
            entry = self._staging.reserve(request.transfer_id, len(layout), request.first_block, request.num_blocks,
                                          request.block_bytes, time.monotonic())
        except Exception as exc:  # noqa: BLE001 - StagingFull or a bad request: the sender fails the push
            return KVReserved(error=f"{type(exc).__name__}: {exc}")
        return KVReserved(region=STAGING_REGION, offset=entry.offset)

    def on_notify(self, peer: str, message: bytes, error: str | None) -> None:
        note = KV_NOTE_DECODER.decode(message)
        if error is not None:
            with self._stats_lock:
                self._stats.checksum_failures += "checksum" in error.lower()
            self._staging.fail(note.transfer_id, f"layer {note.layer}: {error}", time.monotonic(), note.slot)
            return
        try:
            self._staging.landed(note.transfer_id, note.layer, note.first_block, note.end_block, time.monotonic(),
                                 slot=note.slot)
        except (KeyError, ValueError) as exc:  # dropped or expired meanwhile, or a note that does not fit
            # Refused, so the prefill's push fails (kv_error) instead of reporting landed KV that
            # nothing here will use.
            log.warning("refusing a KV note from %s: %s", peer, exc)
            raise NotifyRefused(str(exc)) from exc
        with self._stats_lock:
            self._stats.received_blocks += note.end_block - note.first_block

    # -- landing (engine thread) --------------------------------------------------------------

    def start_load_kv(self, loads: list[LoadSpec]) -> None:
        now = time.monotonic()
        for spec in loads:
            self._pending[spec.request_id] = _PendingLoad(spec, deadline=now + spec.wait_timeout_s)

    def collect_loads(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Land complete transfers; returns (finished, failed) request ids. Failed ones are also
        finished, as vLLM requires, so the scheduler releases them to recompute."""
        now = time.monotonic()
        finished: set[str] = set()
        failed: set[str] = set()
        for req_id in finished_req_ids & self._pending.keys():
            # Aborted while waiting for its KV: vLLM keeps its blocks until this worker reports it
            # in finished_recving (its delayed free), so it is reported here, once. Not failed:
            # there is nothing to recompute.
            self._staging.pop(self._pending.pop(req_id).spec.transfer_id, now)
            finished.add(req_id)
        for req_id, pending in list(self._pending.items()):
            # Claimed, the slot is ours until released: a drop or a new reservation of the
            # transfer from another thread cannot free it under the copy.
            staged = self._staging.claim(pending.spec.transfer_id)
            if staged is not None:
                error = staged.error if staged.error is not None else self._land_or_error(pending.spec, staged)
                self._staging.release(staged, now)
            elif now < pending.deadline:
                continue
            else:
                error = f"no KV after {pending.spec.wait_timeout_s:.1f} s"
                with self._stats_lock:
                    self._stats.load_timeouts += 1
                self._staging.pop(pending.spec.transfer_id, now)  # what arrived of it, if anything
            del self._pending[req_id]
            finished.add(req_id)
            if error is not None:
                log.warning("KV load for %s failed (%s); recomputing its prompt", req_id, error)
                failed.add(req_id)
                with self._stats_lock:
                    self._stats.load_failures += 1
        for transfer_id in self._staging.expire(now):
            log.warning("dropped unclaimed KV transfer %s after its TTL", transfer_id)
        return finished, failed

    def _land_or_error(self, spec: LoadSpec, staged: StagedTransfer) -> str | None:
        """`_land`, with any exception turned into an error: it would otherwise escape
        get_transfer_results and end vLLM's worker; a failed load only costs a recompute."""
        try:
            return self._land(spec, staged)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the blocks it half wrote get recomputed
            log.exception("landing KV transfer %s for %s failed", spec.transfer_id, spec.request_id)
            return f"landing failed: {type(exc).__name__}: {exc}"

    def _land(self, spec: LoadSpec, staged: StagedTransfer) -> str | None:
        """Copy a staged transfer's blocks into the paged cache; returns an error string or None."""
        start = time.perf_counter()
        first, count = spec.first_block - staged.first_block, len(spec.block_ids)
        if first < 0:
            return (f"the prefill skipped blocks [0, {staged.first_block}) this worker was thought to hold, "
                    f"but it holds only [0, {spec.first_block})")
        if first + count > staged.num_blocks:
            return f"the prefill pushed blocks up to {staged.first_block + staged.num_blocks}, " \
                   f"{spec.first_block + count} needed"
        nbytes, size = 0, staged.block_bytes
        for name, index in self._layer_index.items():
            cache = self._kv_caches[name]
            begin = staged.layer_offset(index) + first * size
            raw = self._arena[begin: begin + count * size]
            flat = self._cache_bytes.get(name)
            if flat is not None:
                for position, block, run in runs(spec.block_ids):
                    np.copyto(flat[block * size:(block + run) * size],
                              raw[position * size:(position + run) * size])
            else:  # device memory, or strided blocks: one copy in and one index_copy_ per layer
                rows = torch.from_numpy(raw).view(cache.dtype).view(count, *cache.shape[1:])
                ids = torch.tensor(spec.block_ids, dtype=torch.long, device=cache.device)
                cache.index_copy_(0, ids, rows.to(cache.device, non_blocking=False))
            nbytes += raw.nbytes
        with self._stats_lock:
            self._stats.loaded_transfers += 1
            self._stats.loaded_tokens += spec.num_tokens - spec.first_block * self._block_size
            self._stats.loaded_bytes += nbytes
            self._stats.loaded_blocks += count * len(self._layer_index)
            self._stats.load_seconds += time.perf_counter() - start
        return None
