"""Prefill-side selection policies (paper section 5).

Each policy turns (request, prefill pool, PrefixMatches) into a PrefillChoice: where to
prefill, how much prefix is reused, whether to fetch a longer prefix from another holder,
and the predicted TTFT = T_transfer + T_queue + T_prefill.

  random          any instance, uniformly; it still reuses whatever it holds locally.
  load-balance    the instance with the shortest queue (T_queue).
  cache-aware     the instance with the lowest T_queue + T_prefill(L, its local prefix).
  kvcache-centric Algorithm 1: for each instance, if best_len / its_len reaches
                  kvcache_balancing_threshold it fetches the best holder's prefix (paying
                  T_transfer, and so replicating a hot prefix: hot-spot migration), else it
                  recomputes from its own prefix; the lowest TTFT wins.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from conductor.core.admission import prefill_keeps_batch_tbt
from conductor.core.config import Policy, SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.types import InstanceState, Role


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    instance_id: str
    cached_tokens: int
    fetch_from: str | None
    fetched_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float

    @property
    def ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class PrefixMatches:
    """Longest prefix of the prompt, in blocks, per instance. stored: what the index says an
    instance holds now (only that can be fetched from it). local: stored or pending there, what
    a request queued on that instance will find cached when it runs (see PendingPrefixes).
    load_s: seconds an instance spends loading the part of its stored prefix that it holds only
    in its KVCache pool (by tier, Estimators.pool_load_s) before reusing it; absent: none."""

    stored: Mapping[str, int]
    local: Mapping[str, int]
    load_s: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, stored: Mapping[str, int], pending: Mapping[str, int],
           load_s: Mapping[str, float] | None = None) -> PrefixMatches:
        load_s = load_s or {}
        if not pending:
            return cls(stored, stored, load_s)
        local = dict(stored)
        for inst, blocks in pending.items():
            if blocks > local.get(inst, 0):
                local[inst] = blocks
        return cls(stored, local, load_s)

    def load_of(self, instance_id: str) -> float:
        return self.load_s.get(instance_id, 0.0)


def prefix_tokens(blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Reusable tokens of a prefix of `blocks` blocks; at least one token is always computed
    (the engine needs the last position's logits), as vLLM does."""
    return max(0, min(blocks * block_size, prompt_tokens - 1))


def _local(inst: InstanceState, prompt: int, matches: PrefixMatches, est: Estimators,
           cfg: SchedulerConfig) -> PrefillChoice:
    cached = prefix_tokens(matches.local.get(inst.instance_id, 0), prompt, cfg.block_size)
    return PrefillChoice(inst.instance_id, cached, None, 0, est.queue_s(inst),
                         est.prefill_s(prompt, cached, inst.prefill_scale) + matches.load_of(inst.instance_id), 0.0)


def best_holder(matches: Mapping[str, int], instances: Sequence[InstanceState]) -> tuple[InstanceState | None, int]:
    """FindBestPrefixMatch: the holder of the longest prefix that can be fetched from (an instance
    that does not serve fetches is passed over); ties go to the least busy link."""
    best: InstanceState | None = None
    best_blocks = 0
    for inst in instances:
        if not inst.serves_fetches:
            continue
        blocks = matches.get(inst.instance_id, 0)
        if blocks > best_blocks or (blocks == best_blocks and blocks and best is not None
                                    and inst.pending_send_bytes < best.pending_send_bytes):
            best, best_blocks = inst, blocks
    return best, best_blocks


def kvcache_centric(prompt: int, pool: Sequence[InstanceState], all_instances: Sequence[InstanceState],
                    matches: PrefixMatches, est: Estimators, cfg: SchedulerConfig) -> PrefillChoice:
    holder, best_blocks = best_holder(matches.stored, all_instances)
    best_tokens = prefix_tokens(best_blocks, prompt, cfg.block_size)
    # What an instance pays besides its queue depends only on its local prefix length, and most
    # instances share one (usually none): price each distinct length once. At 1,024 instances
    # this loop is most of a decision.
    priced: dict[int, PrefillChoice] = {}
    best: tuple[float, InstanceState, float, float, PrefillChoice] | None = None
    for inst in pool:
        local_blocks = matches.local.get(inst.instance_id, 0)
        price = priced.get(local_blocks)
        if price is None:
            price = priced[local_blocks] = _price(prompt, local_blocks, holder, best_blocks, best_tokens, est, cfg)
        queue = est.queue_s(inst)
        # price.prefill_s is the prior's; each instance scales it by its calibrated speed, and
        # loads what of its own prefix it holds only in its pool.
        prefill = price.prefill_s * inst.prefill_scale + matches.load_of(inst.instance_id)
        ttft = price.transfer_s + queue + prefill  # as PrefillChoice.ttft_s sums it
        if best is None or ttft < best[0]:
            best = (ttft, inst, queue, prefill, price)
    assert best is not None
    _, inst, queue, prefill, price = best
    return replace(price, instance_id=inst.instance_id, queue_s=queue, prefill_s=prefill)


def _price(prompt: int, local_blocks: int, holder: InstanceState | None, best_blocks: int, best_tokens: int,
           est: Estimators, cfg: SchedulerConfig) -> PrefillChoice:
    """The choice for an instance holding local_blocks, before its own id, queue and prefill scale
    are applied (prefill_s is the prior's):
    fetch the best holder's longer prefix if best/local reaches the threshold (or it holds
    none), else recompute beyond its own prefix. Beyond Algorithm 1, a fetch that is predicted
    to take longer than computing those tokens (a short prefix over a slow or busy link) is not
    made: the threshold only says when a fetch is worth considering."""
    cached = prefix_tokens(local_blocks, prompt, cfg.block_size)
    local = PrefillChoice("", cached, None, 0, 0.0, est.prefill_s(prompt, cached), 0.0)
    fetch = cfg.remote_fetch and holder is not None and best_blocks > local_blocks and (
        local_blocks == 0 or best_blocks / local_blocks >= cfg.kvcache_balancing_threshold)
    if not fetch:
        return local
    assert holder is not None
    fetched = best_tokens - cached
    choice = PrefillChoice("", best_tokens, holder.instance_id, fetched, 0.0, est.prefill_s(prompt, best_tokens),
                           est.transfer_s(fetched, holder))
    return choice if choice.ttft_s < local.ttft_s else local


def choose_prefill(policy: Policy, prompt: int, pool: Sequence[InstanceState],
                   all_instances: Sequence[InstanceState], matches: PrefixMatches,
                   est: Estimators, cfg: SchedulerConfig, rng: random.Random) -> PrefillChoice:
    """The prefill choice of `policy` over a non-empty pool."""
    if policy is Policy.RANDOM:
        return _local(rng.choice(pool), prompt, matches, est, cfg)
    if policy is Policy.LOAD_BALANCE:
        return _local(min(pool, key=est.queue_s), prompt, matches, est, cfg)
    if policy is Policy.CACHE_AWARE:
        return min((_local(i, prompt, matches, est, cfg) for i in pool), key=lambda c: c.ttft_s)
    return kvcache_centric(prompt, pool, all_instances, matches, est, cfg)


def chunked_prefill_s(inst: InstanceState, prompt: int, cached: int, est: Estimators,
                      cfg: SchedulerConfig) -> tuple[float, float]:
    """(seconds to its first token, longest step) of prefilling prompt[cached:] on `inst` as
    vLLM runs it beside a running batch: steps of the instance's chunk_tokens new tokens (or
    cfg.chunk_tokens where it has none), each one also
    stepping the batch, so each step is a gap between the running requests' tokens. Without
    a running or incoming batch, the whole prefill and no gap (nobody waits between tokens there)."""
    if not inst.running and not inst.incoming:
        return est.prefill_s(prompt, cached, inst.prefill_scale), 0.0
    decode = est.tbt_s(inst.batch_size, inst.kv_tokens, inst.decode_scale) if inst.running else 0.0
    total = longest = 0.0
    done = cached
    chunk = inst.chunk_tokens if inst.chunk_tokens > 0 else cfg.chunk_tokens  # (a step takes at least one)
    while done < prompt:
        end = min(done + chunk, prompt)
        step = est.prefill_s(end, done, inst.prefill_scale) + decode
        total += step
        longest = max(longest, step)
        done = end
    return total, longest


def own_prefill(inst: InstanceState, prompt: int, matches: PrefixMatches, est: Estimators,
                cfg: SchedulerConfig) -> tuple[int, float, float]:
    """(cached tokens, seconds to the first token, longest step) of prefilling on `inst` from the
    prefix it holds or will hold when it runs (matches.local), fetching nothing: what only its
    pool holds is loaded first, the rest computed in chunks beside its batch (chunked_prefill_s)."""
    cached = prefix_tokens(matches.local.get(inst.instance_id, 0), prompt, cfg.block_size)
    prefill, longest = chunked_prefill_s(inst, prompt, cached, est, cfg)
    return cached, prefill + matches.load_of(inst.instance_id), longest


def flexible_prefill(prompt: int, pool: Sequence[InstanceState], matches: PrefixMatches, est: Estimators,
                     cfg: SchedulerConfig, now: float) -> tuple[PrefillChoice, float] | None:
    """Flexible roles: Algorithm 1 over every instance, whatever its label, for a prefill whose
    KV goes to another instance. A decode-labelled instance pays cfg.role_cost_s; one with a
    running or incoming batch prefills in chunks (chunked_prefill_s) and is a candidate only if
    each chunk step keeps that batch within its TBT SLO (prefill_keeps_batch_tbt; `now` dates
    the incoming sequences' arrivals). Returns (choice, its role cost), the lowest TTFT + role
    cost, or None when no instance may take it."""
    holder, best_blocks = best_holder(matches.stored, pool)
    best_tokens = prefix_tokens(best_blocks, prompt, cfg.block_size)
    priced: dict[int, PrefillChoice] = {}
    best: tuple[float, InstanceState, float, float, PrefillChoice] | None = None
    for inst in pool:
        local_blocks = matches.local.get(inst.instance_id, 0)
        price = priced.get(local_blocks)
        if price is None:
            price = priced[local_blocks] = _price(prompt, local_blocks, holder, best_blocks, best_tokens, est, cfg)
        load = matches.load_of(inst.instance_id)
        if inst.running or inst.incoming:
            prefill, longest = chunked_prefill_s(inst, prompt, price.cached_tokens, est, cfg)
            prefill += load
            if not prefill_keeps_batch_tbt(inst, now + est.queue_s(inst) + prefill, longest, est, cfg):
                continue
        else:
            prefill = price.prefill_s * inst.prefill_scale + load
        cost = cfg.role_cost_s if inst.role is Role.DECODE else 0.0
        queue = est.queue_s(inst)
        score = price.transfer_s + queue + prefill + cost
        if best is None or score < best[0]:
            best = (score, inst, queue, prefill, price)
    if best is None:
        return None
    _, inst, queue, prefill, price = best
    cost = cfg.role_cost_s if inst.role is Role.DECODE else 0.0
    return replace(price, instance_id=inst.instance_id, queue_s=queue, prefill_s=prefill), cost
