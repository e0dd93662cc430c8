"""The scheduler core: one request, one cluster snapshot, one clock reading -> a decision.

Algorithm (paper Algorithm 1 plus sections 4 and 6):
  1. Match the prompt's block keys against the global prefix index, and against the blocks
     that prefills already dispatched will store (reusable by a request queued behind them).
  2. Prefill side: the policy picks a prefill instance and whether to fetch a longer prefix
     (policies.py), giving the predicted TTFT.
  3. Decode side: the instance with the lowest predicted TBT with this request added, as
     seen by the admission policy's views of decode load (admission.py).
  4. Conditional disaggregation (kvcache-centric only): a prompt whose uncached part fits in
     one step may be prefilled on a decode instance itself, if that step keeps the running
     batch within the TBT SLO and gives a lower TTFT than the disaggregated pair. With no
     prefill pool at all (a colocated cluster) every request is prefilled on a decode
     instance, whatever its size, under every policy and the same admission.
  Flexible roles (flexible_roles, kvcache-centric): labels are only a cost. The candidates
     are the labelled pair of 2-3, the best prefill on any instance (a busy one in TBT-safe
     chunks) with the best other decode instance, and prefill-and-decode on any one instance;
     the lowest TTFT + role costs among those that pass admission wins.
  5. Admission: refuse when the predicted TTFT breaks the SLO (all but "none"), or when the
     decode side does not fit (early, prediction), with a Retry-After from predicted drain.
     The SLOs are the request's own, less the headroom it keeps for more important classes
     (admission.limits_for); every TBT check also keeps the tightest SLO of the batch joined.

The scheduler is pure apart from the random policy's seeded generator; it never reads a
clock or does I/O, so the live conductor and the simulator run the same object.
"""

from __future__ import annotations

import math
import random

from conductor.core.admission import DecodeChoice, Horizon, Limits, LoadView, batch_tbt_slo_s, choose_decode, \
    choose_decode_flexible, decode_admits, decode_drain_s, limits_for, prefill_keeps_batch_tbt, rank_and_gate, views_for
from conductor.core.config import Admission, Policy, SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.policies import PrefillChoice, PrefixMatches, choose_prefill, chunked_prefill_s, flexible_prefill, \
    own_prefill, prefix_tokens
from conductor.core.types import ClusterState, Decision, InstanceState, RejectReason, Rejection, Request, Role

__all__ = ["Scheduler", "decode_admits"]


class Scheduler:
    """schedule() is the only entry point; it does not mutate the cluster state or index."""

    def __init__(self, config: SchedulerConfig, estimators: Estimators) -> None:
        self.config = config
        self.estimators = estimators
        self._rng = random.Random(config.seed)  # only the random policy draws from it

    def schedule(self, request: Request, state: ClusterState, now: float) -> Decision | Rejection:
        cfg, est = self.config, self.estimators
        prompt = request.prompt_tokens
        if prompt <= 0:
            raise ValueError(f"request {request.request_id}: prompt_tokens must be positive")
        flexible = cfg.flexible_roles
        # With flexible roles every instance may prefill and decode.
        prefill_pool = state.instances if flexible else state.prefill
        decode_pool = state.instances if flexible else state.decode
        if not decode_pool:
            return Rejection(request.request_id, RejectReason.NO_INSTANCE, cfg.max_retry_after_s)
        blocks = request.block_hashes
        stored = state.index.match(blocks) if blocks else {}
        matches = PrefixMatches.of(stored, state.pending.match(blocks) if blocks and state.pending else {},
                                   self._pool_load_s(state, blocks, stored))
        t_d = state.mean_decode_s or cfg.default_decode_s
        views = views_for(cfg.admission)
        rng = self._rng if cfg.policy is Policy.RANDOM else None
        lim = limits_for(request, cfg)

        pchoice: PrefillChoice | None = None
        dchoice: DecodeChoice | None = None
        if flexible:
            pchoice, dchoice = self._flexible(prompt, state, matches, views, now, t_d, lim)
        elif state.prefill:
            pchoice = choose_prefill(cfg.policy, prompt, state.prefill, state.instances, matches, est, cfg,
                                     self._rng)
            dchoice = choose_decode(state.decode, prompt, views, self._horizon(now, pchoice.ttft_s, t_d), est, cfg, lim,
                                    rng)
        if not flexible and (not state.prefill
                             or (cfg.policy is Policy.KVCACHE_CENTRIC and cfg.conditional_disaggregation)):
            coloc = self._colocated(prompt, state.decode, matches, views, now, t_d, lim, rng, forced=not state.prefill)
            if coloc is not None and (pchoice is None or coloc[0].ttft_s < pchoice.ttft_s):
                pchoice, dchoice = coloc
        if pchoice is None or dchoice is None:
            return Rejection(request.request_id, RejectReason.NO_INSTANCE, cfg.max_retry_after_s)

        ttft = pchoice.ttft_s
        # Where the prompt may be prefilled: a cluster without prefill instances prefills on decode.
        prefills_on = prefill_pool or decode_pool
        # Each candidate's (queue, the part of its TTFT no wait removes): queues drain at one
        # second per second. Priced only for a TTFT past the limit, where it decides the answer.
        waits = self._waits(pchoice, prompt, prefills_on, matches) if ttft > lim.ttft_s else []
        unattainable = bool(waits) and not any(floor <= lim.ttft_s for _, floor in waits)
        # Best effort only on an idle cluster (under load it would take time from requests that can
        # still meet their SLO), and not for a request that asked for a TTFT tighter than the
        # server's: it said a late answer is of no use.
        asked_tighter = request.ttft_slo_s is not None and request.ttft_slo_s < cfg.ttft_slo_s
        may_best_effort = cfg.best_effort_when_idle and not asked_tighter
        best_effort = (unattainable and may_best_effort
                       and pchoice.queue_s <= 0.0 and all(est.queue_s(i) <= 0.0 for i in prefills_on))
        if cfg.admission is not Admission.NONE and ttft > lim.ttft_s and not best_effort:
            retry, helps = self._ttft_retry(waits, lim, unattainable, may_best_effort)
            # A retry takes this much of the prefill compute of the instances that may prefill it.
            slot = pchoice.prefill_s / max(len(prefills_on), 1)
            return Rejection(request.request_id, RejectReason.TTFT_SLO, retry, ttft, dchoice.tbt_s, helps,
                             unattainable, slot)
        # A one-token answer prefilled elsewhere never joins the decode batch (colocated, its
        # prompt's KV still needs the room there).
        prefill_only = request.ends_at_prefill and pchoice.instance_id != dchoice.instance_id
        if cfg.admission in (Admission.EARLY, Admission.PREDICTION) and dchoice.problem is not None and not prefill_only:
            drain = decode_drain_s(decode_pool, prompt, now, t_d, est, cfg, lim)
            # Sequences leave the decode pool about this often; a retry takes the room of one.
            slot = t_d / max(sum(len(i.running) + len(i.incoming) for i in decode_pool), 1)
            return Rejection(request.request_id, dchoice.problem, self._clip_retry(drain - ttft), ttft, dchoice.tbt_s,
                             math.isfinite(drain), slot_s=slot)
        return Decision(
            request_id=request.request_id,
            prefill_instance=pchoice.instance_id,
            decode_instance=dchoice.instance_id,
            cached_prefix_tokens=pchoice.cached_tokens,
            fetch_from=pchoice.fetch_from,
            fetched_blocks=math.ceil(pchoice.fetched_tokens / cfg.block_size),
            predicted_ttft_s=ttft,
            predicted_tbt_s=dchoice.tbt_s,
            predicted_queue_s=pchoice.queue_s,
            predicted_prefill_s=pchoice.prefill_s,
            predicted_transfer_s=pchoice.transfer_s,
            best_effort=best_effort and cfg.admission is not Admission.NONE,
        )

    def decode_admits(self, decode: InstanceState, kv_tokens: int) -> RejectReason | None:
        """The decode instance's own check on arrival of a prefilled request's KV."""
        return decode_admits(decode, kv_tokens, self.estimators, self.config)

    # -- helpers --------------------------------------------------------------------------

    def _pool_load_s(self, state: ClusterState, blocks: tuple, stored: dict[str, int]) -> dict[str, float]:
        """Per instance, the seconds to load the part of its stored prefix it holds only in its
        KVCache pool (PrefixIndex tiers), priced by tier; instances with none are absent."""
        load: dict[str, float] = {}
        bs = self.config.block_size
        for inst, n in stored.items():
            counts = state.index.pool_only_blocks(inst, blocks, n)
            if counts:
                load[inst] = self.estimators.pool_load_s({tier: c * bs for tier, c in counts.items()})
        return load

    def _colocated(self, prompt: int, pool: tuple[InstanceState, ...], matches: PrefixMatches,
                   views: tuple[LoadView, LoadView], now: float, t_d: float, lim: Limits,
                   rng: random.Random | None, forced: bool = False) -> tuple[PrefillChoice, DecodeChoice] | None:
        """Best 'prefill on the decode instance itself' option, if any is allowed.

        forced: there is no prefill pool, so this is a colocated cluster and every decode
        instance is a candidate whatever the prompt's size; the step that carries a long
        prefill stalls the running batch, the price disaggregation exists to avoid. The
        policy still picks (random, shortest queue, or lowest TTFT), and a candidate that
        fails the decode gate is kept, carrying its problem, so admission can refuse with
        the right reason."""
        cfg, est = self.config, self.estimators
        cands: list[tuple[PrefillChoice, DecodeChoice]] = []
        for inst in pool:
            cached = prefix_tokens(matches.local.get(inst.instance_id, 0), prompt, cfg.block_size)
            if not forced and prompt - cached > cfg.colocate_max_new_tokens:
                continue
            load = matches.load_of(inst.instance_id)
            if inst.running:
                # vLLM computes it in steps of the instance's chunk, each also stepping the running
                # batch (chunked_prefill_s): every step is a gap between the batch's tokens, so the
                # longest must meet their SLO itself, and the first token comes after all of them.
                prefill, step = chunked_prefill_s(inst, prompt, cached, est, cfg)
                prefill, step = prefill + load, step + load
                budget = batch_tbt_slo_s(inst, cfg)
            else:  # nobody waits between tokens here: the one-step budget of conditional disaggregation
                prefill = step = est.prefill_s(prompt, cached, inst.prefill_scale) + load
                budget = cfg.tbt_slo_s
            if not forced and step > budget:
                continue
            queue = est.queue_s(inst)
            d = rank_and_gate(inst, prompt, views, self._horizon(now, queue + prefill, t_d), est, cfg, lim)
            if not forced and d.problem is not None:
                continue
            cands.append((PrefillChoice(inst.instance_id, cached, None, 0, queue, prefill, 0.0), d))
        if not cands:
            return None
        if forced and rng is not None:
            return rng.choice(cands)
        fitting = [c for c in cands if c[1].problem is None] or cands
        if forced and cfg.policy is Policy.LOAD_BALANCE:
            return min(fitting, key=lambda c: c[0].queue_s)
        return min(fitting, key=lambda c: c[0].ttft_s)

    def _flexible(self, prompt: int, state: ClusterState, matches: PrefixMatches, views: tuple[LoadView, LoadView],
                  now: float, t_d: float, lim: Limits) -> tuple[PrefillChoice | None, DecodeChoice | None]:
        """Flexible roles: the best of three kinds of candidate, by (fails the decode gate, breaks
        the TTFT SLO, predicted TTFT + role costs). Role costs only rank: admission judges the
        plain predicted TTFT. Exact ties keep the first candidate, so labels win them.
          1. the labelled pair: the fixed-roles choice (prefill-labelled P, decode-labelled D);
          2. a pair on any instances: the best P of any label (flexible_prefill), then the best
             other instance to decode (choose_decode_flexible);
          3. prefill and decode on one instance of any label, chunked beside its running batch
             if it has one, and only if each chunk step keeps that batch within the TBT SLO.
             A prefill-labelled instance pays a role cost for decoding; a decode-labelled one
             pays it for a prefill beyond conditional disaggregation's one-step budget."""
        cfg, est = self.config, self.estimators
        check_ttft = cfg.admission is not Admission.NONE
        best: tuple[tuple[bool, bool, float], PrefillChoice, DecodeChoice] | None = None

        def offer(p: PrefillChoice, d: DecodeChoice, cost: float) -> None:
            nonlocal best
            ttft = p.ttft_s
            key = (d.problem is not None, check_ttft and ttft > lim.ttft_s, ttft + cost)
            if best is None or key < best[0]:
                best = (key, p, d)

        if state.prefill and state.decode:
            p = choose_prefill(Policy.KVCACHE_CENTRIC, prompt, state.prefill, state.instances, matches, est, cfg,
                               self._rng)
            offer(p, choose_decode(state.decode, prompt, views, self._horizon(now, p.ttft_s, t_d), est, cfg, lim), 0.0)
        flex = flexible_prefill(prompt, state.instances, matches, est, cfg, now)
        if flex is not None:
            p, pcost = flex
            d = choose_decode_flexible(state.instances, prompt, views, self._horizon(now, p.ttft_s, t_d), est, cfg,
                                       lim, exclude=p.instance_id)
            if d is not None:
                offer(p, d[0], pcost + d[1])
        budget = cfg.colocate_max_new_tokens if cfg.conditional_disaggregation else -1
        for inst in state.instances:
            cached, prefill, longest = own_prefill(inst, prompt, matches, est, cfg)
            if inst.role is Role.PREFILL:
                cost = cfg.role_cost_s  # decoding against its label
            else:
                cost = cfg.role_cost_s if prompt - cached > budget else 0.0
            queue = est.queue_s(inst)
            d = rank_and_gate(inst, prompt, views, self._horizon(now, queue + prefill, t_d), est, cfg, lim)
            if not prefill_keeps_batch_tbt(inst, now + queue + prefill, longest, est, cfg):
                # It would break the batch's TBT (running or coming): kept as a misfit so that,
                # if nothing else fits, admission refuses it for the TBT SLO, as in fixed roles.
                d = DecodeChoice(inst.instance_id, longest, RejectReason.TBT_SLO)
            offer(PrefillChoice(inst.instance_id, cached, None, 0, queue, prefill, 0.0), d, cost)
        if best is None:
            return None, None
        return best[1], best[2]

    def _horizon(self, now: float, ttft: float, t_d: float) -> Horizon:
        return Horizon(now, now + ttft, t_d, self.config.decode_forecast == "fluid")

    def _waits(self, choice: PrefillChoice, prompt: int, pool: tuple[InstanceState, ...],
               matches: PrefixMatches) -> list[tuple[float, float]]:
        """(queue, floor) of the chosen prefill and, under a policy that chooses by TTFT, of each
        other instance that may prefill the prompt from its own prefix, as it would run there
        (in chunks beside its batch): the floor is the TTFT left once its queue has drained.
        Another instance may win once queues drain (one whose prefix is longer, behind a longer
        queue); random and load-balance would not choose it for that."""
        out = [(choice.queue_s, choice.ttft_s - choice.queue_s)]
        cfg, est = self.config, self.estimators
        if cfg.policy not in (Policy.CACHE_AWARE, Policy.KVCACHE_CENTRIC):
            return out
        for inst in pool:
            if inst.instance_id != choice.instance_id:
                out.append((est.queue_s(inst), own_prefill(inst, prompt, matches, est, cfg)[1]))
        return out

    def _ttft_retry(self, waits: list[tuple[float, float]], lim: Limits, unattainable: bool,
                    may_best_effort: bool) -> tuple[float, bool]:
        """(Retry-After seconds, whether a retry can succeed at all). unattainable: every floor
        breaks the SLO, so no wait helps, but one that may be served best effort is, once every
        queue has drained."""
        if unattainable:
            if may_best_effort:
                return self._clip_retry(max(queue for queue, _ in waits)), True
            return self.config.max_retry_after_s, False
        # The earliest an instance whose floor fits can meet the SLO.
        return self._clip_retry(min(queue + floor for queue, floor in waits if floor <= lim.ttft_s) - lim.ttft_s), True

    def _clip_retry(self, seconds: float) -> float:
        cfg = self.config
        if not math.isfinite(seconds):
            return cfg.max_retry_after_s
        return min(max(seconds, cfg.min_retry_after_s), cfg.max_retry_after_s)
