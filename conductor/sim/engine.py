"""Discrete-event replay of a trace against N prefill and M decode instances.

Each arrival builds a frozen ClusterState snapshot and asks the very Scheduler the live
conductor uses. Then the engine plays out the physics (cost_model.py):
  - a prefill node runs one prompt at a time, FIFO; a fetched prefix is pulled over the
    holder's link (FIFO per sender) starting at dispatch, and the prompt starts when both
    the node and the fetched blocks are ready; finished blocks enter its LRU pool, whose
    stored/evicted events update the global prefix index;
  - the KV reaches the decode node kv_handoff_s after prefill ends (layer-wise streaming);
    under any admission but "none" the decode node re-checks (decode_admits) and may refuse,
    wasting the prefill; under "none" a request without KV room waits for room (one larger
    than the node's whole KV capacity is refused, as it could wait forever, also after a
    colocated prefill);
  - a decode node steps its continuous batch; a colocated prefill rides in one step (whole,
    however long: with no prefill pool that is a colocated cluster, whose long prefills stall
    the batch), reusing the prefix blocks the node keeps from its own earlier prefills.
Requests join and leave the batch only at step boundaries.
These are fixed roles; flexible roles, where every node prefills and decodes, are flex.py's.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from conductor.core.config import Admission
from conductor.core.estimators import DecodeTimeMeter
from conductor.core.policies import prefix_tokens
from conductor.core.scheduler import Scheduler
from conductor.core.types import ClusterState, Decision, Rejection, Request
from conductor.sim.cost_model import CostModel
from conductor.sim.instances import BlockPool, DecodeNode, Job, PrefillNode
from conductor.sim.report import Outcome, SimResult, TimelinePoint
from conductor.sim.trace import TraceRecord

ARRIVE, PREFILL_DONE, KV_ARRIVE, STEP_DONE, SAMPLE, WAKE = range(6)


@dataclass(frozen=True, slots=True)
class SimConfig:
    n_prefill: int = 8
    """Prefill instances."""
    n_decode: int = 8
    """Decode instances."""
    speedup: float = 1.0
    """Replay speed: trace timestamps are divided by this (2 = twice the load)."""
    prefill_cache_blocks: int = 4768
    """KVCache pool of each prefill node, in blocks."""
    decode_cache_blocks: int | None = None
    """Prefix blocks a decode node keeps from the prompts it prefilled itself (colocated), in
    blocks. None = its whole KV capacity: vLLM's prefix cache lives in free KV blocks, so this
    is the most it could hold (optimistic for colocated prefill)."""
    decode_kv_capacity_tokens: int = 1_378_784
    """KV room of each decode node's batch, in tokens."""
    bandwidth_Bps: float = 100e9
    """Each node's outgoing link for KV transfers."""
    block_size: int = 512
    """Tokens per trace block (hash_id)."""
    sample_interval_s: float = 5.0
    """Load timeline resolution, simulated seconds."""
    min_decode_samples: int = 20
    """Completed requests needed before the measured mean decode time is reported."""
    decode_time: str = "little"
    """How the shell measures the mean decode time t_d it reports to the scheduler: "little"
    (Little's law, occupancy / completion rate, exponentially weighted; core DecodeTimeMeter)
    or "mean" (mean of the completed decode durations so far, biased low while the pool fills)."""
    decode_time_tau_s: float = 300.0
    """Time constant of the "little" meter, simulated seconds."""
    pending_prefixes: bool = True
    """Tell the scheduler which blocks the prefills already dispatched to each instance will
    store (core PendingPrefixes), as the live router does; False = only stored blocks count."""
    oracle_lengths: bool = False
    """Tell the scheduler every sequence's true remaining output length (DecodeSeq
    .remaining_tokens), so prediction forecasts per request: what a perfect output-length
    predictor would give, an upper bound that no live cluster has."""
    max_tokens_known: bool = False
    """Tell the scheduler each sequence's max_tokens, taken to be its trace output length, as the
    live conductor knows every request's max_tokens: exact for a workload whose outputs run to
    their cap (`mooncake bench`'s ignore_eos), a lower bound on the cap otherwise. Unlike
    oracle_lengths it is only a cap: the forecast and the stall rule read it, nothing else."""
    progress: bool = False
    """Show a tqdm progress bar on stderr."""

    def __post_init__(self) -> None:
        if self.n_prefill < 0 or self.n_decode <= 0 or self.n_prefill + self.n_decode <= 0:
            raise ValueError("need n_prefill >= 0 and n_decode >= 1")
        if not (self.speedup > 0 and math.isfinite(self.speedup)):
            raise ValueError(f"speedup must be a positive number, got {self.speedup}")
        if min(self.prefill_cache_blocks, self.decode_kv_capacity_tokens, self.block_size) <= 0:
            raise ValueError("cache, KV capacity and block size must be positive")
        if self.decode_cache_blocks is not None and self.decode_cache_blocks < 0:
            raise ValueError(f"decode_cache_blocks must be >= 0, got {self.decode_cache_blocks}")
        if self.bandwidth_Bps <= 0 or self.sample_interval_s <= 0:
            raise ValueError("bandwidth and sample interval must be positive")
        if self.decode_time not in ("little", "mean"):
            raise ValueError(f"decode_time must be 'little' or 'mean', got {self.decode_time!r}")


FLEXIBLE_ROLES_ELSEWHERE = (
    "this Simulation models fixed roles (its prefill nodes never decode); flexible roles are "
    "conductor.sim.flex.FlexSimulation's (simulate() picks it)")


class Simulation:
    """Fixed roles: prefill nodes prefill, decode nodes decode (and, under conditional
    disaggregation, prefill a prompt of their own whole in one step)."""

    def __init__(self, trace: list[TraceRecord], scheduler: Scheduler, cost: CostModel, config: SimConfig) -> None:
        from conductor.core.index import PendingPrefixes, PrefixIndex

        if scheduler.config.flexible_roles != self.flexible_roles:
            raise ValueError(FLEXIBLE_ROLES_ELSEWHERE if self.flexible_roles is False else
                             "FlexSimulation needs a scheduler with flexible_roles")
        self.trace, self.scheduler, self.cost, self.config = trace, scheduler, cost, config
        self.index = PrefixIndex()
        self.pending = PendingPrefixes() if config.pending_prefixes else None
        self.prefills: dict[str, PrefillNode] = {}
        self.decodes: dict[str, DecodeNode] = {}
        self._make_nodes()
        self.outcomes: list[Outcome] = []
        self.timeline: list[TimelinePoint] = []
        self.step_times: list[tuple[float, int]] = []
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._coloc: dict[str, Job | None] = {d: None for d in self.decodes}
        self._decode_sum, self._decode_n = 0.0, 0
        self._meter = DecodeTimeMeter(config.decode_time_tau_s, config.min_decode_samples)
        self._n_decoding = 0
        self._wasted_prefill_s = 0.0
        self._live = 0  # events other than SAMPLE still queued

    flexible_roles = False

    def _decode_cache_blocks(self) -> int:
        config = self.config
        return config.decode_kv_capacity_tokens // config.block_size if config.decode_cache_blocks is None \
            else config.decode_cache_blocks

    def _make_nodes(self) -> None:
        config = self.config
        self.prefills = {f"p{i}": PrefillNode(f"p{i}", config.prefill_cache_blocks, config.bandwidth_Bps, self.index)
                         for i in range(config.n_prefill)}
        self.decodes = {f"d{i}": DecodeNode(f"d{i}", config.decode_kv_capacity_tokens, config.bandwidth_Bps,
                                           BlockPool(f"d{i}", self._decode_cache_blocks(), self.index),
                                           config.oracle_lengths, config.max_tokens_known)
                        for i in range(config.n_decode)}

    # -- event plumbing -------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        if kind != SAMPLE:
            self._live += 1

    def run(self) -> SimResult:
        t0 = min(rec.timestamp_ms for rec in self.trace)  # traces need not be sorted
        span_s = (max(rec.timestamp_ms for rec in self.trace) - t0) / 1000.0 / self.config.speedup
        if not math.isfinite(span_s):
            raise ValueError(f"speedup {self.config.speedup:g} spreads the trace over {span_s} s: too small")
        for rid, rec in enumerate(self.trace):
            self._push((rec.timestamp_ms - t0) / 1000.0 / self.config.speedup, ARRIVE, rid)
        self._push(0.0, SAMPLE, None)
        handlers = {ARRIVE: self._arrive, PREFILL_DONE: self._prefill_done, KV_ARRIVE: self._kv_arrive,
                    STEP_DONE: self._step_done, WAKE: self._wake}
        wall = time.perf_counter()
        bar = tqdm(total=len(self.trace), file=sys.stderr, disable=not self.config.progress, unit="req",
                   desc="sim", mininterval=0.5)
        now = last = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            if kind == SAMPLE:
                self._sample(now)
                if self._live:
                    # Nothing changes between events: across an idle gap (a trace's quiet hours, or
                    # timestamps far apart) the next sample waits for the next event.
                    self._push(max(now + self.config.sample_interval_s, self._events[0][0]), SAMPLE, None)
                continue
            self._live -= 1
            last = now
            handlers[kind](now, payload)
            if kind == ARRIVE:
                bar.update(1)
        bar.close()
        if len(self.outcomes) != len(self.trace):  # every request ends completed or rejected
            raise RuntimeError(f"simulation ended with {len(self.trace) - len(self.outcomes)} of "
                               f"{len(self.trace)} requests neither completed nor rejected")
        return SimResult(outcomes=self.outcomes, timeline=self.timeline, step_times=self.step_times,
                         makespan_s=last, wall_s=time.perf_counter() - wall, wasted_prefill_s=self._wasted_prefill_s)

    def _state(self, now: float) -> ClusterState:
        insts = tuple(p.snapshot(now) for p in self.prefills.values()) + \
            tuple(d.snapshot(now) for d in self.decodes.values())
        if self.config.decode_time == "little":
            mean = self._meter.mean_decode_s(now)
        else:
            mean = self._decode_sum / self._decode_n if self._decode_n >= self.config.min_decode_samples else None
        return ClusterState(insts, self.index, mean, self.pending)

    def _full_blocks(self, rec: TraceRecord) -> tuple[int, ...]:
        return rec.hash_ids[: rec.input_length // self.config.block_size]

    # -- handlers -------------------------------------------------------------------------

    def _route(self, now: float, rid: int) -> tuple[Job, Decision] | None:
        """Ask the scheduler; a refusal is an outcome (None), a decision a job on its way to its
        decode node."""
        rec = self.trace[rid]
        blocks = self._full_blocks(rec)
        request = Request(str(rid), rec.input_length, blocks, now, ends_at_prefill=rec.output_length <= 1)
        res = self.scheduler.schedule(request, self._state(now), now)
        if isinstance(res, Rejection):
            self.outcomes.append(Outcome(rid, now, rec.input_length, rec.output_length, "rejected", res.reason.value))
            return None
        assert isinstance(res, Decision)
        job = Job(rid, now, rec.input_length, rec.output_length, blocks, res.decode_instance,
                  res.predicted_prefill_s, now + res.predicted_ttft_s, colocated=res.colocated,
                  route=self._route_kind(res))
        self.decodes[res.decode_instance].expect(job)
        if self.pending is not None:
            self.pending.add(res.prefill_instance, blocks)
        return job, res

    @staticmethod
    def _route_kind(res: Decision) -> str:
        return "colocated" if res.colocated else "disaggregated"

    def _book_fetch(self, job: Job, res: Decision, now: float) -> None:
        """A prefix fetched from another node comes over the holder's link (FIFO per sender),
        from dispatch on; the prompt may start once it is here."""
        if res.fetch_from is None:
            return
        sender = self.prefills.get(res.fetch_from) or self.decodes[res.fetch_from]
        start = max(now, sender.link_free_s)
        sender.link_free_s = start + self.cost.transfer_s(res.fetched_blocks * self.config.block_size,
                                                          sender.bandwidth_Bps)
        job.fetch_ready_s = sender.link_free_s
        job.fetch_blocks = math.ceil(res.cached_prefix_tokens / self.config.block_size)

    def _arrive(self, now: float, rid: int) -> None:
        routed = self._route(now, rid)
        if routed is None:
            return
        job, res = routed
        if res.colocated:
            d = self.decodes[res.decode_instance]
            d.coloc_queue.append(job)
            d.coloc_pred_s += job.predicted_prefill_s
            if not d.stepping:
                self._start_step(d, now)
            return
        p = self.prefills[res.prefill_instance]
        self._book_fetch(job, res, now)
        p.queue.append(job)
        p.queued_pred_s += job.predicted_prefill_s
        if p.current is None:
            self._start_prefill(p, now)

    def _start_prefill(self, p: PrefillNode, now: float) -> None:
        job = p.queue.popleft()
        p.queued_pred_s -= job.predicted_prefill_s
        start = max(now, job.fetch_ready_s)
        if job.fetch_blocks:
            p.cache.store(job.hash_ids[: job.fetch_blocks])  # hot-spot migration: the copy stays here
        blocks = p.cache.local_prefix_blocks(job.hash_ids)
        dur = self.cost.prefill_s(job.prompt, prefix_tokens(blocks, job.prompt, self.config.block_size))
        p.current, p.current_pred_end_s = job, start + job.predicted_prefill_s
        job.prefill_start_s, job.prefill_actual_s = start, dur
        p.busy_s += dur
        self._push(start + dur, PREFILL_DONE, p)

    def _prefill_done(self, now: float, p: PrefillNode) -> None:
        job = p.current
        assert job is not None
        p.cache.store(job.hash_ids)
        if self.pending is not None:
            self.pending.discard(p.id, job.hash_ids)
        p.current = None
        job.first_token_s = now
        if job.output <= 1:  # the first token ends it: the answer leaves with it, D drops the staged KV
            self.decodes[job.decode_id].arrived(job.rid)
            self._complete(job, now)
        else:
            self._push(now + self.cost.config.kv_handoff_s, KV_ARRIVE, job)
        if p.queue:
            self._start_prefill(p, now)

    def _kv_arrive(self, now: float, job: Job) -> None:
        d = self.decodes[job.decode_id]
        d.arrived(job.rid)
        if self.scheduler.config.admission is not Admission.NONE:
            hold = self.scheduler.config.decode_hold_s
            if hold > 0 and (d.held or self._decode_refuses(d, job, now)):
                job.hold_until_s = now + hold  # FIFO behind earlier held arrivals
                d.held.append(job)
                self._release_held(d, now)
                if not d.stepping:
                    self._start_step(d, now)
                return
            reason = self._decode_refuses(d, job, now)
            if reason is not None:
                self._refuse_after_prefill(job, reason.value)
                return
        self._enter_decode(d, job, now)

    def _decode_refuses(self, d: DecodeNode, job: Job, now: float):
        return self.scheduler.decode_admits(d.snapshot(now), job.prompt + sum(j.prompt for j in d.waiting))

    def _refuse_after_prefill(self, job: Job, reason: str) -> None:
        self._wasted_prefill_s += job.prefill_actual_s
        self.outcomes.append(Outcome(rid=job.rid, arrival_s=job.arrival_s, prompt=job.prompt, output=job.output,
                                     status="rejected", reason=f"decode_{reason}",
                                     ttft_s=job.first_token_s - job.arrival_s, colocated=job.colocated,
                                     route=job.route))

    def _release_held(self, d: DecodeNode, now: float) -> None:
        """At a step boundary (or an arrival): admit held requests in order while they fit;
        refuse those whose hold has expired, or that cannot fit even on an empty node."""
        while d.held:
            job = d.held[0]
            reason = self._decode_refuses(d, job, now)
            if reason is None:
                d.held.popleft()
                self._enter_decode(d, job, now, start=False)
            elif now >= job.hold_until_s or (not d.running and not d.waiting):
                d.held.popleft()
                self._refuse_after_prefill(job, reason.value)
            else:
                break

    def _enter_decode(self, d: DecodeNode, job: Job, now: float, start: bool = True) -> None:
        # Checked here, on every path into the batch (after a prefill node's handoff or a colocated
        # prefill alike): such a prompt would wait at the head of d.waiting for KV room forever,
        # blocking every request behind it, as admission "none" never refuses.
        if job.prompt > d.kv_capacity:
            self._refuse_after_prefill(job, "no_capacity")
            return
        if job.output <= 1:
            self._complete(job, now)
            return
        d.waiting.append(job)  # joins at the next step boundary, when KV room allows
        if start and not d.stepping:
            self._start_step(d, now)

    def _admit_waiting(self, d: DecodeNode, now: float) -> None:
        while d.waiting and d.kv_tokens + d.waiting[0].prompt <= d.kv_capacity:
            d.join(d.waiting.popleft(), now)
            self._n_decoding += 1
            self._meter.set_decoding(now, self._n_decoding)

    def _batch_step(self, d: DecodeNode, now: float) -> tuple[int, float]:
        """At a step boundary: let held and waiting sequences in, then (batch size, the seconds
        of one decode step of it, 0 for none)."""
        if d.held:
            self._release_held(d, now)
        self._admit_waiting(d, now)
        batch = len(d.running)
        return batch, self.cost.decode_step_s(batch, d.kv_tokens) if batch else 0.0

    def _run_step(self, d: DecodeNode, now: float, dur: float, batch: int) -> None:
        """The step starts now and ends `dur` later."""
        if batch:
            self.step_times.append((dur, batch))
        d.stepping = True
        self._push(now + dur, STEP_DONE, d)

    def _start_step(self, d: DecodeNode, now: float) -> None:
        batch, dur = self._batch_step(d, now)
        if d.coloc_queue:
            job = d.coloc_queue.popleft()
            d.coloc_pred_s -= job.predicted_prefill_s
            job.prefill_start_s = now
            cached = prefix_tokens(d.cache.local_prefix_blocks(job.hash_ids), job.prompt, self.config.block_size)
            job.prefill_actual_s = self.cost.prefill_s(job.prompt, cached)
            dur += job.prefill_actual_s
            self._coloc[d.id] = job
        elif not batch:
            d.stepping = False
            return
        self._run_step(d, now, dur, batch)

    def _step_done(self, now: float, d: DecodeNode) -> None:
        self._advance_batch(d, now)
        job = self._coloc[d.id]
        if job is not None:
            self._coloc[d.id] = None
            job.first_token_s = now
            d.cache.store(job.hash_ids)
            if self.pending is not None:
                self.pending.discard(d.id, job.hash_ids)
            d.arrived(job.rid)
            self._enter_decode(d, job, now)
        self._start_step(d, now)

    def _advance_batch(self, d: DecodeNode, now: float) -> None:
        """A step has ended: every running sequence has one token more; those at their end leave."""
        if not d.running:
            return
        d.step += 1
        d.kv_tokens += len(d.running)
        done = d.finish_due()
        if done:
            self._n_decoding -= len(done)
            self._meter.completed(now, len(done))
            self._meter.set_decoding(now, self._n_decoding)
        for job in done:
            self._decode_sum += now - job.join_s
            self._decode_n += 1
            self._complete(job, now)

    def _prefilling_nodes(self) -> list:
        """The nodes whose queues the timeline's prefill_queue_s averages."""
        return list(self.prefills.values())

    def _wake(self, now: float, d: DecodeNode) -> None:
        """An idle node's next work became ready (FlexSimulation: a fetched prefix arrived)."""
        if not d.stepping:
            self._start_step(d, now)

    def _complete(self, job: Job, now: float) -> None:
        tbt = (now - job.first_token_s) / (job.output - 1) if job.output > 1 else None
        self.outcomes.append(Outcome(rid=job.rid, arrival_s=job.arrival_s, prompt=job.prompt, output=job.output,
                                     status="completed", ttft_s=job.first_token_s - job.arrival_s, tbt_s=tbt,
                                     finish_s=now, colocated=job.colocated, route=job.route))

    def _sample(self, now: float) -> None:
        ps = [p.snapshot(now).queued_prefill_s for p in self._prefilling_nodes()]
        ds = list(self.decodes.values())
        kv = [d.kv_tokens / d.kv_capacity for d in ds]
        tbt = [self.scheduler.estimators.tbt_s(len(d.running), d.kv_tokens) if d.running else 0.0 for d in ds]
        self.timeline.append(TimelinePoint(
            t_s=now,
            prefill_queue_s=sum(ps) / len(ps) if ps else 0.0,
            decode_batch=sum(len(d.running) for d in ds) / len(ds),
            decode_kv_util=sum(kv) / len(kv),
            decode_tbt_s=sum(tbt) / len(tbt),
        ))
