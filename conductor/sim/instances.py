"""Simulated instances: a prefill node (FIFO of whole-prompt jobs, an LRU KVCache pool that
reports to the prefix index, an outgoing link) and a decode node (continuous batching,
bounded KV, optional colocated prefill with its own prefix pool). They keep their own mutable
state; the engine drives them and turns them into frozen InstanceState snapshots for the
scheduler.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from conductor.core.index import PrefixIndex
from conductor.core.types import DecodeSeq, InstanceState, Role, SeqTotals


@dataclass(slots=True)
class Job:
    """One request in flight."""

    rid: int
    arrival_s: float
    prompt: int
    output: int
    hash_ids: tuple[int, ...]
    decode_id: str
    predicted_prefill_s: float
    predicted_arrival_s: float  # when the scheduler expects the KV at the decode instance
    colocated: bool = False  # prefilled on its decode instance
    route: str = "disaggregated"  # "colocated", "disaggregated" or "flexible" (a label broken), as live
    fetch_blocks: int = 0  # leading blocks fetched from another holder before prefill
    fetch_ready_s: float = 0.0
    prefill_start_s: float = 0.0
    first_token_s: float = 0.0
    prefill_actual_s: float = 0.0
    prefill_done: int = 0  # prompt tokens computed so far (FlexSimulation's chunked prefill)
    # decode-side bookkeeping
    join_s: float = 0.0
    hold_until_s: float = 0.0
    join_step: int = 0


class BlockPool:
    """An instance's LRU pool of prefix blocks; stored and evicted blocks are reported to the
    global prefix index under the owning instance's id, as a live worker's KV events are."""

    def __init__(self, owner_id: str, capacity_blocks: int, index: PrefixIndex) -> None:
        self.owner_id, self.capacity_blocks, self.index = owner_id, capacity_blocks, index
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def local_prefix_blocks(self, hash_ids: tuple[int, ...]) -> int:
        n = 0
        for h in hash_ids:
            if h not in self.blocks:
                break
            n += 1
        return n

    def store(self, hash_ids: tuple[int, ...]) -> None:
        """Put blocks in the pool (most recent last) and report stored/evicted to the index."""
        blocks, new = self.blocks, []
        for h in hash_ids:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                new.append(h)
        evicted = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        if new:
            self.index.apply_stored(self.owner_id, new)
        if evicted:
            self.index.apply_removed(self.owner_id, evicted)


class PrefillNode:
    def __init__(self, instance_id: str, cache_blocks: int, bandwidth_Bps: float, index: PrefixIndex) -> None:
        self.id = instance_id
        self.bandwidth_Bps = bandwidth_Bps
        self.queue: deque[Job] = deque()
        self.current: Job | None = None
        self.current_pred_end_s = 0.0
        self.queued_pred_s = 0.0  # predicted seconds of jobs waiting (not the current one)
        self.link_free_s = 0.0
        self.cache = BlockPool(instance_id, cache_blocks, index)
        self.busy_s = 0.0

    def pending_send_bytes(self, now: float) -> float:
        return max(self.link_free_s - now, 0.0) * self.bandwidth_Bps

    def snapshot(self, now: float) -> InstanceState:
        queued = self.queued_pred_s + (max(self.current_pred_end_s - now, 0.0) if self.current else 0.0)
        return InstanceState(self.id, Role.PREFILL, queued_prefill_s=queued, bandwidth_Bps=self.bandwidth_Bps,
                             pending_send_bytes=self.pending_send_bytes(now))


@dataclass(order=True, slots=True)
class _Finish:
    step: int
    rid: int
    job: Job = field(compare=False)


class _SeqTally:
    """SeqTotals of a set of sequences that come and go, kept at O(1) a change (the minimum
    over the distinct TBT SLOs, of which there are a few)."""

    def __init__(self) -> None:
        self.kv_tokens = 0
        self.unknown_lengths = 0
        self.config_slos = 0
        self.capped = 0
        self.slos: Counter[float] = Counter()

    def change(self, seq: DecodeSeq, sign: int) -> None:
        self.kv_tokens += sign * seq.kv_tokens
        self.unknown_lengths += sign * (seq.remaining_tokens is None)
        self.capped += sign * (seq.max_tokens is not None)
        if seq.tbt_slo_s is None:
            self.config_slos += sign
        else:
            self.slos[seq.tbt_slo_s] += sign
            if not self.slos[seq.tbt_slo_s]:
                del self.slos[seq.tbt_slo_s]

    def totals(self) -> SeqTotals:
        return SeqTotals(self.kv_tokens, self.unknown_lengths == 0, min(self.slos, default=math.inf),
                         self.config_slos > 0, self.capped > 0)


class DecodeNode:
    role = Role.DECODE

    def __init__(self, instance_id: str, kv_capacity: int, bandwidth_Bps: float, cache: BlockPool,
                 oracle_lengths: bool = False, max_tokens_known: bool = False) -> None:
        self.id = instance_id
        self.kv_capacity = kv_capacity
        self.bandwidth_Bps = bandwidth_Bps
        self.cache = cache  # prefix blocks of prompts prefilled here (colocated), as vLLM's prefix cache
        self.link_free_s = 0.0  # it can be a fetch source for those blocks
        self.oracle_lengths = oracle_lengths  # snapshots carry each sequence's remaining length
        self.max_tokens_known = max_tokens_known  # snapshots carry each sequence's max_tokens (its output length)
        self.running: dict[int, Job] = {}
        self.finishing: list[_Finish] = []  # heap by the step at which each sequence ends
        self.incoming: dict[int, Job] = {}  # through expect() and arrived() only
        # Their snapshot sequences, made once each: a snapshot per arrival rebuilding one per
        # request on its way made an overloaded run (thousands on their way) quadratic.
        self._incoming_seqs: dict[int, DecodeSeq] = {}
        self._incoming_tally = _SeqTally()
        self.waiting: deque[Job] = deque()  # admitted but no KV room yet (admission "none")
        self.held: deque[Job] = deque()  # refused on arrival, held until room or hold_until_s
        self.coloc_queue: deque[Job] = deque()
        self.coloc_pred_s = 0.0
        self.step = 0  # steps completed
        self.kv_tokens = 0
        self.stepping = False
        self._version = 0  # bumped whenever the running set changes
        self._snap_key: tuple[int, int] | None = None
        self._snap_running: tuple[DecodeSeq, ...] = ()

    def expect(self, job: Job) -> None:
        """The job is routed here: its KV (or its colocated prefill) is on its way."""
        self.incoming[job.rid] = job
        # The first token comes from prefill, so output - 1 remain for decode.
        seq = DecodeSeq(job.predicted_arrival_s, job.prompt, job.output - 1 if self.oracle_lengths else None,
                        max_tokens=self._max_tokens(job))
        self._incoming_seqs[job.rid] = seq
        self._incoming_tally.change(seq, +1)

    def arrived(self, rid: int) -> Job:
        self._incoming_tally.change(self._incoming_seqs.pop(rid), -1)
        return self.incoming.pop(rid)

    def _max_tokens(self, job: Job) -> int | None:
        return job.output if self.max_tokens_known else None

    def kv_of(self, job: Job) -> int:
        return job.prompt + (self.step - job.join_step)

    def join(self, job: Job, now: float) -> None:
        job.join_s, job.join_step = now, self.step
        self.running[job.rid] = job
        self._version += 1
        self.kv_tokens += job.prompt
        # The first token came from prefill; output-1 more come from decode steps.
        heapq.heappush(self.finishing, _Finish(self.step + max(job.output - 1, 0), job.rid, job))

    def finish_due(self) -> list[Job]:
        done = []
        while self.finishing and self.finishing[0].step <= self.step:
            job = heapq.heappop(self.finishing).job
            self.kv_tokens -= self.kv_of(job)
            del self.running[job.rid]
            self._version += 1
            done.append(job)
        return done

    def queued_prefill_s(self, now: float) -> float:
        """Predicted seconds of prefill given to it and not done: its colocated prompts."""
        return self.coloc_pred_s

    def snapshot(self, now: float) -> InstanceState:
        key = (self.step, self._version)
        oracle = self.oracle_lengths
        if key != self._snap_key:  # sequences' KV grows each step: rebuild at most once per step
            self._snap_running = tuple(
                DecodeSeq(j.join_s, self.kv_of(j), j.join_step + j.output - 1 - self.step if oracle else None,
                          max_tokens=self._max_tokens(j))
                for j in self.running.values())
            self._snap_key = key
        incoming, totals = tuple(self._incoming_seqs.values()), self._incoming_tally.totals()
        if self.waiting or self.held:  # arrived, not yet in the batch (no KV room yet)
            arrived = tuple(DecodeSeq(now, j.prompt, j.output - 1 if oracle else None, max_tokens=self._max_tokens(j))
                            for j in (*self.waiting, *self.held))
            incoming, totals = incoming + arrived, totals.plus(SeqTotals.of(arrived))
        return InstanceState(self.id, self.role, queued_prefill_s=self.queued_prefill_s(now), running=self._snap_running,
                             incoming=incoming, incoming_totals=totals, kv_capacity_tokens=self.kv_capacity, bandwidth_Bps=self.bandwidth_Bps,
                             pending_send_bytes=max(self.link_free_s - now, 0.0) * self.bandwidth_Bps)
