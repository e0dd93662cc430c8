"""The simulator with flexible roles (SchedulerConfig.flexible_roles, the live cluster's default):
every instance may prefill and decode, and its label ("p" or "d") is only a cost to the scheduler.

Each node is one engine, as vLLM runs it (docs/SCHEDULER.md, flexible roles):
  - a FIFO of prompts to prefill (its own requests' and those whose KV goes to another node) and a
    continuous batch of sequences decoding, both stepped by one engine;
  - a step with a running batch, or with sequences on their way to the node, computes at most
    `chunk_tokens` of the prompt at the head of the FIFO plus one token of every running
    sequence, so the step is a gap between those sequences' tokens; otherwise a step computes
    the rest of the prompt whole (the scheduler prices both so: policies.chunked_prefill_s);
  - a prompt that fetches its prefix from another node starts once the blocks are there
    (Simulation's link model), and holds the FIFO until then, as on a fixed-roles prefill node;
  - a finished prompt's KV reaches its decode node kv_handoff_s later, or joins this node's own
    batch at once; decode admission, holds, KV room and the decode-time meter are Simulation's.
The scheduler sees each node's queue (predicted seconds, drained at one second per second from a
prompt's start; the live ledger starts the clock when the prompt reaches the head of the queue,
which differs only while the head waits for a fetched prefix), its batch, and the sequences on
their way to it.
"""

from __future__ import annotations

from collections import deque

from conductor.core.policies import prefix_tokens
from conductor.core.types import Decision, Role
from conductor.sim.engine import KV_ARRIVE, WAKE, Simulation
from conductor.sim.instances import BlockPool, DecodeNode, Job


def route_kind(prefill: Role, decode: Role, colocated: bool) -> str:
    """As the live conductor counts routes (conductor/routing.py): colocated (P = D),
    disaggregated (a prefill-labelled P, a decode-labelled D), or flexible (a label broken)."""
    if colocated:
        return "colocated"
    return "flexible" if prefill is Role.DECODE or decode is Role.PREFILL else "disaggregated"


class FlexNode(DecodeNode):
    """One engine that prefills (in chunks beside its batch) and decodes."""

    def __init__(self, instance_id: str, role: Role, kv_capacity: int, bandwidth_Bps: float, cache: BlockPool,
                 chunk_tokens: int, oracle_lengths: bool = False, max_tokens_known: bool = False) -> None:
        super().__init__(instance_id, kv_capacity, bandwidth_Bps, cache, oracle_lengths, max_tokens_known)
        self.role = role
        self.chunk_tokens = chunk_tokens
        self.queue: deque[Job] = deque()  # prompts waiting to start
        self.queued_pred_s = 0.0  # their predicted prefill seconds
        self.current: Job | None = None  # the prompt being computed
        self.current_pred_end_s = 0.0
        self.chunk_end = 0  # prompt tokens done once the step in flight ends (0: no chunk in it)
        self.busy_s = 0.0

    def queued_prefill_s(self, now: float) -> float:
        running = max(self.current_pred_end_s - now, 0.0) if self.current is not None else 0.0
        return self.queued_pred_s + running


class FlexSimulation(Simulation):
    flexible_roles = True

    def _make_nodes(self) -> None:
        config, chunk = self.config, self.scheduler.config.chunk_tokens
        nodes: dict[str, DecodeNode] = {}
        for prefix, count, role, blocks in (("p", config.n_prefill, Role.PREFILL, config.prefill_cache_blocks),
                                            ("d", config.n_decode, Role.DECODE, self._decode_cache_blocks())):
            for i in range(count):
                name = f"{prefix}{i}"
                nodes[name] = FlexNode(name, role, config.decode_kv_capacity_tokens, config.bandwidth_Bps,
                                       BlockPool(name, blocks, self.index), chunk, config.oracle_lengths,
                                       config.max_tokens_known)
        self.prefills, self.decodes = {}, nodes  # every node decodes; `decodes` holds them all

    def _prefilling_nodes(self) -> list:
        return list(self.decodes.values())

    def _route_kind(self, res: Decision) -> str:
        return route_kind(self.decodes[res.prefill_instance].role, self.decodes[res.decode_instance].role,
                          res.colocated)

    def _arrive(self, now: float, rid: int) -> None:
        routed = self._route(now, rid)
        if routed is None:
            return
        job, res = routed
        node = self.decodes[res.prefill_instance]
        assert isinstance(node, FlexNode)
        self._book_fetch(job, res, now)
        node.queue.append(job)
        node.queued_pred_s += job.predicted_prefill_s
        if not node.stepping:
            self._start_step(node, now)

    def _start_step(self, node: DecodeNode, now: float) -> None:
        assert isinstance(node, FlexNode)
        batch, dur = self._batch_step(node, now)
        if node.current is None and node.queue and node.queue[0].fetch_ready_s <= now:
            self._begin_prompt(node, now)
        job = node.current
        if job is not None:
            # In chunks while a batch runs or sequences are on their way here (they join between
            # chunks), as the scheduler prices it (policies.chunked_prefill_s); else whole.
            chunked = batch or any(rid != job.rid for rid in node.incoming)
            end = min(job.prefill_done + node.chunk_tokens, job.prompt) if chunked else job.prompt
            chunk_s = self.cost.prefill_s(end, job.prefill_done)
            job.prefill_actual_s += chunk_s
            node.busy_s += chunk_s
            node.chunk_end = end
            dur += chunk_s
        elif not batch:
            node.stepping = False
            if node.queue:  # its head waits for a fetched prefix
                self._push(node.queue[0].fetch_ready_s, WAKE, node)
            return
        self._run_step(node, now, dur, batch)

    def _begin_prompt(self, node: FlexNode, now: float) -> None:
        job = node.queue.popleft()
        node.queued_pred_s -= job.predicted_prefill_s
        if job.fetch_blocks:
            node.cache.store(job.hash_ids[: job.fetch_blocks])  # hot-spot migration: the copy stays here
        cached = prefix_tokens(node.cache.local_prefix_blocks(job.hash_ids), job.prompt, self.config.block_size)
        job.prefill_start_s, job.prefill_done, job.prefill_actual_s = now, cached, 0.0
        node.current, node.current_pred_end_s = job, now + job.predicted_prefill_s

    def _step_done(self, now: float, node: DecodeNode) -> None:
        assert isinstance(node, FlexNode)
        self._advance_batch(node, now)
        job = node.current
        if job is not None and node.chunk_end:
            job.prefill_done, node.chunk_end = node.chunk_end, 0
            if job.prefill_done >= job.prompt:
                node.current = None
                self._prompt_done(node, job, now)
        self._start_step(node, now)

    def _prompt_done(self, node: FlexNode, job: Job, now: float) -> None:
        job.first_token_s = now
        node.cache.store(job.hash_ids)
        if self.pending is not None:
            self.pending.discard(node.id, job.hash_ids)
        if job.decode_id == node.id:  # its own batch: joins at this step boundary
            node.arrived(job.rid)
            self._enter_decode(node, job, now, start=False)
        elif job.output <= 1:  # the first token ends it: the decode node only drops the staged KV
            self.decodes[job.decode_id].arrived(job.rid)
            self._complete(job, now)
        else:
            self._push(now + self.cost.config.kv_handoff_s, KV_ARRIVE, job)
