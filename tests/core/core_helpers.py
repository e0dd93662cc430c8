"""Hand-built states for driving the scheduler core with round numbers."""

from __future__ import annotations

from conductor.core import (ClusterState, DecodeModel, DecodeSeq, Estimators, InstanceState, PendingPrefixes,
                            PrefillModel, PrefixIndex, Request, Role, Scheduler, SchedulerConfig)

# 1 ms per new prompt token; TBT = 10 ms + 1 ms per sequence; 1 KB of KV per token.
EST = Estimators(PrefillModel(0.0, 0.001, 0.0, 0.0), DecodeModel(0.01, 0.001, 0.0), kv_bytes_per_token=1000,
                 transfer_latency_s=0.0)
BS = 10  # tokens per block in these tests


def prefill(iid: str, queued: float = 0.0, bw: float = 1e7, pending: float = 0.0) -> InstanceState:
    return InstanceState(iid, Role.PREFILL, queued_prefill_s=queued, bandwidth_Bps=bw, pending_send_bytes=pending)


def decode(iid: str, batch: int = 0, kv_each: int = 100, cap: int = 10**9, incoming: int = 0, start: float = 0.0,
           queued: float = 0.0) -> InstanceState:
    run = tuple(DecodeSeq(start, kv_each) for _ in range(batch))
    inc = tuple(DecodeSeq(start, kv_each) for _ in range(incoming))
    return InstanceState(iid, Role.DECODE, queued_prefill_s=queued, running=run, incoming=inc,
                         kv_capacity_tokens=cap)


def state(*insts: InstanceState, index: PrefixIndex | None = None, mean_decode_s: float | None = None,
          pending: PendingPrefixes | None = None) -> ClusterState:
    return ClusterState(tuple(insts), index or PrefixIndex(), mean_decode_s, pending)


def request(prompt: int, n_blocks: int | None = None, rid: str = "r") -> Request:
    n = prompt // BS if n_blocks is None else n_blocks
    return Request(rid, prompt, tuple(range(n)))


def scheduler(**kw) -> Scheduler:
    kw.setdefault("block_size", BS)
    kw.setdefault("conditional_disaggregation", False)
    return Scheduler(SchedulerConfig(**kw), EST)
