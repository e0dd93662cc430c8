"""The producer's data path, in vLLM's worker process: write a prompt's blocks from the paged
cache straight into the decode worker's staging arena through the transfer engine (messenger/).

`save_kv_layer` (vLLM's forward thread) only notes what to send: on CPU the layer's cache tensor
is a registered region and its block rows are contiguous at dim 0, so adjacent blocks become one
slice and nothing is copied on the forward thread. On CUDA the rows are first gathered into a
pinned host buffer on a side stream, in the blocks-first order of mooncake/kv_layout.py (so
FlashAttention's K-first layout travels like FlashInfer's); a CPU cache whose blocks are not
contiguous rows is gathered the same way, without the stream. A sender thread
reserves room on the decode worker once per transfer (`engine.call`), then writes each layer's
slices with a `KVLayerNote` riding on the batch, without waiting for the previous batch. Each
decode worker has its own sender thread, so one that is frozen holds up only its own pushes, each
for at most the timeout.

Nothing holds an engine step: `wait_for_save` returns at once. The request's blocks stay
allocated (vLLM's delayed free: the scheduler half returns True from request_finished) until
`finished_sending` reports it, once every batch of it was acknowledged or failed. The shell asks
`outcome()` before it answers the prefill, so the answer still means "the KV has landed".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field

import msgspec
import torch

from messenger.api import Batch, CallFailed, PeerInfo, Slice, TransferError
from mooncake.kv_layout import block_bytes, blocks_first, direct, runs
from mooncake.protocol import (KV_CALL_ENCODER, KV_RESERVED_DECODER, KVHello, KVLayerNote, KVReserve)
from prefill.push_planner import SaveSpec

# Under "vllm." so the messages show in vLLM's worker processes, whose logging vLLM configures.
log = logging.getLogger("vllm.mooncake." + __name__)

LANE_IDLE_S = 60.0
"""A decode worker's sender thread ends after this long with nothing to send (a worker that left,
or restarted on another port, leaves no thread behind); the next push to it starts another."""
UNREACHABLE_BACKOFF_S = 5.0
"""After a decode worker could not be reached (no answer to the hello or the reservation within
the timeout, a refused connection), pushes to it fail at once for this long: each would otherwise
wait out its own timeout in turn on that worker's sender thread, holding its blocks meanwhile."""
TIMELINE_LENGTH = 64  # transfers kept for the Figure-5 timeline (control op `stats`)
OUTCOMES_KEPT = 4096  # finished transfers whose outcome the shell may still ask for


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class SenderStats:
    """Counters since start; served through the connector's control channel."""

    pushed_transfers: int = 0
    pushed_bytes: int = 0
    push_failures: int = 0
    push_seconds: float = 0.0  # wall time with at least one batch in flight (for bandwidth)
    pushed_blocks: int = 0  # block rows of one layer each, summed over layers


@dataclass
class _Transfer:
    spec: SaveSpec  # the first one; ids, dest, block counts
    num_layers: int
    peer: str | None = None
    region: str = ""
    offset: int = 0
    queued: int = 0  # work items not taken by the sender thread yet
    in_flight: int = 0  # batches written, not acknowledged
    final_layers: int = 0  # layers whose final-step save was called

    @property
    def final_seen(self) -> bool:
        return self.final_layers >= self.num_layers
    request_done: bool = False  # vLLM reported the request finished
    error: str | None = None
    outcome: str | None = None  # "ok" or the error, once decided
    nbytes: int = 0
    chunks: int = 0
    layers: list[list[float]] = field(default_factory=list)  # [computed_s, landed_s] per layer
    step_end_s: float = 0.0


@dataclass(frozen=True)
class _Work:
    transfer: _Transfer  # the one it was queued for (a later transfer of the request may replace it)
    spec: SaveSpec
    layer: int
    computed_s: float
    region: str  # local region holding the rows
    base: int  # offset of block id 0 (the cache itself) or of the gathered rows
    contiguous_ids: bool  # False: rows were gathered, in block_ids order, starting at `base`
    event: object | None = None  # CUDA: the gather's event


class KVSender:
    def __init__(self, engine, *, timeout_s: float = 10.0):
        """`engine`: a started messenger TransferEngine (or anything with its surface)."""
        self._engine = engine
        self._timeout_s = timeout_s
        self._layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self._views: list[torch.Tensor] = []  # blocks-first, per layer
        self._block_bytes: list[int] = []
        self._layout: list[tuple[str, str, list[int]]] = []
        self._device = "cpu"
        self._copy_stream = None
        self._transfers: dict[str, _Transfer] = {}  # by request id, until finished_sending
        self._outcomes: OrderedDict[str, str] = OrderedDict()  # by transfer id
        self._timeline: deque[dict] = deque(maxlen=TIMELINE_LENGTH)
        self._saved_this_step: set[str] = set()
        self._peers: dict[str, str] = {}  # dest address -> engine peer name
        # One sender thread per decode worker (by its address), so that a frozen one holds up only
        # its own pushes, each for at most the timeout, never the other workers'.
        self._lanes: dict[str, queue.Queue[_Work | None]] = {}
        self._lanes_lock = threading.Lock()
        self._lock = threading.Condition()
        self._stats = SenderStats()
        self._busy_since: float | None = None
        self._in_flight_total = 0
        self._gather_seq = 0
        self._unreachable: dict[str, tuple[float, str]] = {}  # dest -> (until, why): see UNREACHABLE_BACKOFF_S

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int | None = None) -> None:
        """`num_blocks`: blocks per layer, which tells the block dim (mooncake/kv_layout.py)."""
        self._layer_names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        for i, cache in enumerate(kv_caches.values()):
            view = blocks_first(cache, num_blocks)
            self._views.append(view)
            self._block_bytes.append(block_bytes(view))
            self._layout.append((self._layer_names[i], dtype_name(view.dtype), list(view.shape[1:])))
            self._device = str(view.device)
            if direct(view):
                self._engine.register(f"kv-layer-{i}", view.view(torch.uint8).view(-1).numpy())
        if self._device.startswith("cuda"):
            self._copy_stream = torch.cuda.Stream(device=self._device)

    # -- forward thread ----------------------------------------------------------------------

    def save_kv_layer(self, saves: list[SaveSpec], layer_name: str, kv_layer: torch.Tensor) -> None:
        if not saves:
            return
        now = time.monotonic()
        index = self._layer_index[layer_name]
        for spec in saves:
            with self._lock:
                transfer = self._transfers.get(spec.request_id)
                if transfer is None or transfer.spec.transfer_id != spec.transfer_id:
                    transfer = _Transfer(spec, len(self._layer_names),
                                         layers=[[0.0, 0.0] for _ in self._layer_names])
                    self._transfers[spec.request_id] = transfer
                transfer.queued += 1
                transfer.final_layers += spec.final
                transfer.layers[index] = [now, 0.0]
                if index == 0:
                    transfer.chunks += 1
                self._saved_this_step.add(spec.request_id)
                if transfer.error is None and transfer.peer is None:
                    unreachable = self._unreachable_now(spec.dest, now)
                    if unreachable:  # its reservation would fail at once: fail it before gathering
                        self._fail(transfer, unreachable)
                failed = transfer.error is not None
            view = self._views[index]  # vLLM's kv_layer is the registered cache of this layer
            if failed:
                # Nothing of it will be sent (its lane skips a failed transfer's work): no rows
                # gathered, which on a GPU would pin host memory per layer and step for nothing
                # while the decode worker stays unreachable.
                work = _Work(transfer, spec, index, now, "", 0, True)
            elif direct(view):
                work = _Work(transfer, spec, index, now, f"kv-layer-{index}", 0, True)
            else:
                work = self._gather(transfer, spec, index, now, view)
            self._enqueue(work)

    def _gather(self, transfer: _Transfer, spec: SaveSpec, index: int, now: float, view: torch.Tensor) -> _Work:
        """Copy the request's rows of one layer into a host buffer, registered as its own region
        until its batch completes. CUDA: pinned memory, on a side stream after the forward's writes
        (wait_stream); the sender thread waits for the copy's event, never the forward thread."""
        event = None
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(view.device))
            with torch.cuda.stream(self._copy_stream):
                # Everything the side stream reads is made on it. Block ids made on the forward's
                # stream were freed as this returned, and the forward's next allocation could be
                # given their memory before the side stream's index_select read them: the last layer
                # of a chunk then gathered the next chunk's blocks (kv_path_cuda at 32k tokens).
                ids = torch.tensor(spec.block_ids, dtype=torch.long, device=view.device)
                host = torch.empty((len(spec.block_ids), *view.shape[1:]), dtype=view.dtype, pin_memory=True)
                host.copy_(view.index_select(0, ids), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        else:
            host = view.index_select(0, torch.tensor(spec.block_ids, dtype=torch.long, device=view.device))
        self._gather_seq += 1
        name = f"kv-rows-{self._gather_seq}"
        if len(spec.block_ids):
            self._engine.register(name, host.view(torch.uint8).view(-1).numpy())
        return _Work(transfer, spec, index, now, name, 0, False, event)

    def wait_for_save(self) -> None:
        """Never waits: the blocks stay allocated until finished_sending (delayed free)."""
        now = time.monotonic()
        with self._lock:
            for req_id in self._saved_this_step:
                transfer = self._transfers.get(req_id)
                if transfer is not None:
                    transfer.step_end_s = now
            self._saved_this_step.clear()

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose sends are all acknowledged or failed: free their blocks now."""
        done: set[str] = set()
        with self._lock:
            for req_id in finished_req_ids & self._transfers.keys():
                self._transfers[req_id].request_done = True
            for req_id, transfer in list(self._transfers.items()):
                if transfer.request_done and transfer.queued == 0 and transfer.in_flight == 0:
                    if not transfer.final_seen:
                        self._decide(transfer, "the request ended before its last prompt chunk")
                    done.add(req_id)
                    del self._transfers[req_id]
        return done

    def settle(self, request_ids: set[str]) -> None:
        """Wait until no send of these requests reads their blocks any more (vLLM preempted them
        and will hand the blocks to others). Bounded: a send still pending after the engine's
        timeout has failed by then, and its transfer with it."""
        deadline = time.monotonic() + self._timeout_s + 1.0
        with self._lock:
            while True:
                busy = [t for r, t in self._transfers.items() if r in request_ids and (t.queued or t.in_flight)]
                left = deadline - time.monotonic()
                if not busy or left <= 0:
                    for transfer in busy:
                        self._fail(transfer, "preempted while its sends were still reading its blocks")
                    return
                self._lock.wait(min(left, 0.05))

    def invalidate(self, request_id: str, transfer_id: str, reason: str) -> None:
        """Blocks this transfer already pushed were computed over KV that failed to load (vLLM
        recomputes them): the transfer fails, even if every layer was acknowledged already, so the
        decode side recomputes instead of using them. Too late once the request left
        finished_sending (the shell asked its outcome before that)."""
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.spec.transfer_id != transfer_id:
                log.warning("KV push %s: %s, but it is no longer tracked", transfer_id, reason)
                return
            self._fail(transfer, reason)
            if self._outcomes.get(transfer_id) == "ok":
                self._outcomes[transfer_id] = reason
                self._stats.pushed_transfers -= 1
                self._lock.notify_all()

    # -- the shell's questions (control thread) ----------------------------------------------

    def outcome(self, transfer_id: str, timeout_s: float) -> str | None:
        """"ok" once every layer of the transfer landed, else why not; None if undecided in time."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while transfer_id not in self._outcomes:
                active = [t for t in self._transfers.values() if t.spec.transfer_id == transfer_id]
                if not active:
                    return f"no KV push for transfer {transfer_id} on this worker"
                if active[0].error is not None:  # failed: say so now, not when its last batch times out
                    return active[0].error
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(left)
            return self._outcomes[transfer_id]

    def stats(self) -> dict:
        with self._lock:
            stats = asdict(self._stats)
            if self._busy_since is not None:
                stats["push_seconds"] += time.monotonic() - self._busy_since
            return stats

    def timeline(self) -> list[dict]:
        with self._lock:
            return list(self._timeline)

    def shutdown(self) -> None:
        with self._lanes_lock:
            for lane in self._lanes.values():
                lane.put(None)
            self._lanes.clear()

    # -- sender threads, one per decode worker -----------------------------------------------

    def _enqueue(self, work: _Work) -> None:
        dest = work.spec.dest
        with self._lanes_lock:  # a lane ends only under this lock, with nothing queued
            lane = self._lanes.get(dest)
            if lane is None:
                lane = self._lanes[dest] = queue.Queue()
                threading.Thread(target=self._run, args=(dest, lane), name=f"kv-push-{dest}", daemon=True).start()
            lane.put(work)

    def _next(self, dest: str, lane: queue.Queue[_Work | None]) -> _Work | None:
        """The lane's next work; None once shut down, or idle for LANE_IDLE_S (the lane is gone)."""
        while True:
            try:
                return lane.get(timeout=LANE_IDLE_S)
            except queue.Empty:
                with self._lanes_lock:
                    if lane.empty():
                        if self._lanes.get(dest) is lane:
                            del self._lanes[dest]
                        return None

    def _run(self, dest: str, lane: queue.Queue[_Work | None]) -> None:
        while (work := self._next(dest, lane)) is not None:
            transfer = work.transfer
            written = False  # a batch took the work's gathered rows (its completion releases them)
            try:
                if transfer.error is None:
                    written = self._send(transfer, work)
            except Exception as exc:  # noqa: BLE001 - any failure fails this transfer, never the thread
                with self._lock:
                    self._fail(transfer, f"{type(exc).__name__}: {exc}")
            finally:
                if not written:
                    self._release_rows(work)
                with self._lock:
                    transfer.queued -= 1
                    self._maybe_done(transfer)

    def _release_rows(self, work: _Work) -> None:
        """Unregister a work's gathered host rows (a pinned buffer on CUDA): once its batch
        completed, or when it was never written (its transfer failed first)."""
        if not work.contiguous_ids and work.spec.block_ids:
            self._engine.unregister(work.region)

    def _send(self, transfer: _Transfer, work: _Work) -> bool:
        """Write one layer's slices; True once a batch owns the work (its completion ends it)."""
        if transfer.peer is None:
            self._reserve(transfer)
            if transfer.error is not None:  # failed (settle: preempted) while the reservation was asked
                return False
        spec, layer = work.spec, work.layer
        if not spec.block_ids:
            with self._lock:
                transfer.layers[layer][1] = time.monotonic()
            return False
        if work.event is not None:
            work.event.synchronize()  # the pinned copy is complete
        size = self._block_bytes[layer]
        slices = []
        pieces = runs(spec.block_ids) if work.contiguous_ids else [(0, 0, len(spec.block_ids))]
        for position, first_id, count in pieces:
            local = work.base + (first_id * size if work.contiguous_ids else 0)
            remote_block = spec.first_block + position - transfer.spec.skip_blocks
            remote = transfer.offset + (layer * (spec.total_blocks - spec.skip_blocks) + remote_block) * size
            slices.append(Slice(work.region, local, transfer.region, remote, count * size))
        note = KV_CALL_ENCODER.encode(KVLayerNote(spec.transfer_id, layer, spec.first_block,
                                                  spec.first_block + len(spec.block_ids), transfer.offset))
        with self._lock:
            transfer.in_flight += 1
            self._in_flight_total += 1
            if self._busy_since is None:
                self._busy_since = time.monotonic()
        try:
            batch = self._engine.write(transfer.peer, slices, note)
        except BaseException:  # no batch, so no completion will count it out: do it here
            with self._lock:
                self._written_out(transfer, time.monotonic())
            raise
        batch.add_done_callback(lambda b: self._acked(transfer, work, b))
        return True

    def _acked(self, transfer: _Transfer, work: _Work, batch: Batch) -> None:
        now = time.monotonic()
        self._release_rows(work)  # the gathered rows are no longer needed
        with self._lock:
            self._written_out(transfer, now)
            if batch.error is not None:
                self._fail(transfer, f"{type(batch.error).__name__}: {batch.error}")
            else:
                transfer.layers[work.layer][1] = now
                transfer.nbytes += batch.nbytes
                self._stats.pushed_bytes += batch.nbytes
                self._stats.pushed_blocks += len(work.spec.block_ids)
            self._maybe_done(transfer)

    def _written_out(self, transfer: _Transfer, now: float) -> None:
        """A written batch is over (under the lock): out of the in-flight counts."""
        transfer.in_flight -= 1
        self._in_flight_total -= 1
        if self._in_flight_total == 0 and self._busy_since is not None:
            self._stats.push_seconds += now - self._busy_since
            self._busy_since = None

    def _unreachable_now(self, dest: str, now: float) -> str | None:
        """Why `dest` is not tried now (under the lock; see UNREACHABLE_BACKOFF_S), or None."""
        until, why = self._unreachable.get(dest, (0.0, ""))
        if now >= until:
            return None
        return f"decode worker at {dest} unreachable {why} (retried after {UNREACHABLE_BACKOFF_S:g} s)"

    def _reserve(self, transfer: _Transfer) -> None:
        spec = transfer.spec
        with self._lock:
            unreachable = self._unreachable_now(spec.dest, time.monotonic())
        if unreachable:
            raise TransferError(unreachable)
        request = KVReserve(spec.transfer_id, spec.skip_blocks, spec.total_blocks - spec.skip_blocks,
                            self._block_bytes[0], self._layout)
        with self._lock:
            fresh = spec.dest not in self._peers  # introduced now, so its description is not stale
        try:
            peer = self._peer(spec.dest)
            raw = self._engine.call(peer, KV_CALL_ENCODER.encode(request), timeout_s=self._timeout_s)
        except CallFailed:  # it answered (its handler failed): reachable
            raise
        except (TransferError, OSError) as exc:
            # Silent or gone (a refusal is an answer: not here). Through a description kept from
            # before, the failure may only say it is stale (a worker restarted at that address):
            # the next push introduces it afresh and is not held back.
            if fresh:
                with self._lock:
                    self._unreachable[spec.dest] = (time.monotonic() + UNREACHABLE_BACKOFF_S,
                                                    f"({type(exc).__name__}: {exc})")
            raise
        with self._lock:
            self._unreachable.pop(spec.dest, None)
        reply = KV_RESERVED_DECODER.decode(raw)
        if reply.error is not None:
            raise TransferError(f"{spec.dest} refused the transfer: {reply.error}")
        with self._lock:
            transfer.peer, transfer.region, transfer.offset = peer, reply.region, reply.offset

    def _peer(self, dest: str) -> str:
        """The engine's name for the decode worker at `dest` (its tcp address), introduced once
        (by `dest`'s own sender thread: nobody else introduces it)."""
        with self._lock:
            name = self._peers.get(dest)
        if name is None:
            bootstrap = f"kv@{dest}"
            self._engine.add_peer(PeerInfo(bootstrap, "", {"tcp": dest}))
            info = msgspec.json.decode(self._engine.call(bootstrap, KV_CALL_ENCODER.encode(KVHello()),
                                                         timeout_s=self._timeout_s), type=PeerInfo)
            self._engine.add_peer(info)  # its full description: the engine may pick shm now
            with self._lock:
                name = self._peers[dest] = info.name
        return name

    # -- outcome (under the lock) ------------------------------------------------------------

    def _fail(self, transfer: _Transfer, error: str) -> None:
        # Introduce the decode worker afresh next time: it may have restarted as another engine.
        self._peers.pop(transfer.spec.dest, None)
        if transfer.error is None:
            transfer.error = error
            log.error("KV push %s failed: %s (decode will recompute the prompt)", transfer.spec.transfer_id, error)
            self._stats.push_failures += 1
            self._lock.notify_all()

    def _maybe_done(self, transfer: _Transfer) -> None:
        if transfer.queued or transfer.in_flight:
            return
        if transfer.error is not None:
            self._decide(transfer, transfer.error)
        elif transfer.final_seen:
            self._decide(transfer, "ok")

    def _decide(self, transfer: _Transfer, outcome: str) -> None:
        transfer_id = transfer.spec.transfer_id
        if transfer_id in self._outcomes:
            return
        self._outcomes[transfer_id] = outcome
        while len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        if outcome == "ok":
            self._stats.pushed_transfers += 1
            self._timeline.append({"transfer_id": transfer_id, "num_tokens": transfer.spec.num_tokens,
                                   "bytes": transfer.nbytes, "chunks": transfer.chunks,
                                   "step_end_s": transfer.step_end_s,
                                   "layers": [list(pair) for pair in transfer.layers]})
        elif transfer.error is None:  # ended unfinished (a failure is counted when it happens)
            self._stats.push_failures += 1
        self._lock.notify_all()
