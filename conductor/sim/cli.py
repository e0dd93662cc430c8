"""`mooncake sim`: replay a Mooncake-format trace through the scheduler core."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from conductor.core.config import (PAPER_BLOCK_SIZE, PAPER_TBT_SLO_S, PAPER_TTFT_SLO_S, Admission, Policy,
                                    SchedulerConfig)
from conductor.core.calibration import cluster_scales, fitted_profile
from conductor.core.estimators import Estimators
from conductor.core.profile_table import ProfileTable, load_profile
from conductor.core.scheduler import Scheduler
from conductor.sim.cost_model import CostModel, CostModelConfig
from conductor.sim.engine import SimConfig, Simulation
from conductor.sim.flex import FlexSimulation
from conductor.sim.report import SimResult, summarize
from conductor.sim.trace import TraceError, TraceRecord, load_trace
from mooncake.trace import block_size_warning
from mooncake.cli_help import DefaultsHelpFormatter

DEFAULT_PROFILE = "paper-70b-8gpu"


def simulate(trace: list[TraceRecord], sched: SchedulerConfig, profile: ProfileTable,
             n_prefill: int = 8, n_decode: int = 8, speedup: float = 1.0, noise_sigma: float = 0.1,
             seed: int = 0, progress: bool = False, **sim_overrides) -> SimResult:
    """Build scheduler, cost model and simulation from one profile table, and run it."""
    est = Estimators.from_profile(profile)
    sim_kwargs = dict(n_prefill=n_prefill, n_decode=n_decode, speedup=speedup,
                      prefill_cache_blocks=profile.prefill_cache_blocks_of(sched.block_size),
                      decode_kv_capacity_tokens=profile.decode_kv_capacity_tokens,
                      bandwidth_Bps=profile.bandwidth_Bps, block_size=sched.block_size, progress=progress)
    sim_kwargs.update(sim_overrides)
    cost = CostModel(est, CostModelConfig(noise_sigma=noise_sigma, seed=seed))
    kind = FlexSimulation if sched.flexible_roles else Simulation
    return kind(trace, Scheduler(sched, est), cost, SimConfig(**sim_kwargs)).run()


def sim_profile(profile: str | None, fitted: pathlib.Path | None) -> ProfileTable:
    """The --profile table, scaled by a live cluster's calibration when --fitted is given."""
    if fitted is None:
        return load_profile(profile or DEFAULT_PROFILE)
    try:
        doc = json.loads(fitted.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--fitted {fitted}: not JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"--fitted {fitted}: not a conductor's /internal/debug/estimators answer")
    prefill_scale, decode_scale = cluster_scales(doc)
    return fitted_profile(load_profile(profile or doc.get("profile") or DEFAULT_PROFILE), prefill_scale, decode_scale)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mooncake sim",
        description="Replay a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length,\n"
                    "hash_ids) against N prefill and M decode instances, scheduling every request with the\n"
                    "same scheduler core as the live conductor, and report TTFT/TBT, SLO attainment and\n"
                    "goodput.",
        formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--trace", required=True, help="path of the trace file (one JSON object per line)")
    ap.add_argument("--prefill", type=int, default=8, metavar="N",
                    help="number of prefill instances; 0 = a colocated cluster (every prompt prefilled on a decode "
                         "instance, stalling its running batch for that step)")
    ap.add_argument("--decode", type=int, default=8, metavar="M", help="number of decode instances")
    ap.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.KVCACHE_CENTRIC.value,
                    help="prefill/decode selection: random; load-balance (shortest prefill queue); cache-aware "
                         "(lowest queue + prefill time with the local prefix); kvcache-centric (paper Algorithm 1: "
                         "may fetch a longer prefix from another holder, and may prefill short prompts on the "
                         "decode instance)")
    ap.add_argument("--admission", choices=[a.value for a in Admission], default=Admission.PREDICTION.value,
                    help="overload control: none (never refuse); baseline (refuse on predicted TTFT; the decode "
                         "instance refuses after prefill); early (also refuse on the decode pool's current load); "
                         "prediction (refuse on the decode load forecast for when prefill ends)")
    ap.add_argument("--speedup", type=float, default=1.0, metavar="X",
                    help="replay X times faster than the trace's timestamps (2 = twice the load)")
    ap.add_argument("--ttft-slo", type=float, default=PAPER_TTFT_SLO_S, metavar="S",
                    help="time-to-first-token SLO, seconds")
    ap.add_argument("--tbt-slo", type=float, default=PAPER_TBT_SLO_S, metavar="S",
                    help="time-between-tokens SLO, seconds")
    ap.add_argument("--profile", default=None, metavar="NAME|PATH",
                    help="profile table the estimators and cost models are fitted from: a bundled name "
                         "(paper-70b-8gpu) or a JSON path written by `mooncake profile` (default: "
                         "paper-70b-8gpu; with --fitted, the profile that conductor runs)")
    ap.add_argument("--fitted", type=pathlib.Path, default=None, metavar="FILE",
                    help="a live conductor's GET /internal/debug/estimators answer, saved: replay with the "
                         "profile scaled by what that cluster measured (the geometric mean of its instances' "
                         "prefill and decode-step scales), to predict that cluster")
    ap.add_argument("--threshold", type=float, default=SchedulerConfig().kvcache_balancing_threshold, metavar="R",
                    help="kvcache_balancing_threshold: fetch a remote prefix when best_len/local_len >= R")
    ap.add_argument("--no-colocate", action="store_true",
                    help="disable conditional disaggregation (prefill on the decode instance)")
    # BooleanOptionalAction: --no-flexible-roles states the paper's fixed roles explicitly (the live
    # conductor's default is flexible, so scripts comparing the two name both).
    ap.add_argument("--flexible-roles", action=argparse.BooleanOptionalAction, default=False,
                    help="any instance may prefill and decode, labels are only a cost (the live conductor's "
                         "default; needs --policy kvcache-centric): each node is one engine that prefills in "
                         "chunks of --chunk-tokens beside its batch. Off: the paper's fixed roles")
    ap.add_argument("--chunk-tokens", type=int, default=SchedulerConfig().chunk_tokens, metavar="T",
                    help="with --flexible-roles: prompt tokens per engine step beside a running batch "
                         "(vLLM's max_num_batched_tokens, the workers' --chunk-size)")
    ap.add_argument("--colocate-max-tokens", type=int, default=SchedulerConfig().colocate_max_new_tokens,
                    metavar="T", help="largest uncached prompt part prefilled in one step on a decode instance")
    ap.add_argument("--gate-headroom", type=float, default=0.0, metavar="F",
                    help="fraction of decode KV capacity the early/prediction gates keep free for forecast error")
    ap.add_argument("--decode-hold", type=float, default=0.0, metavar="S",
                    help="a decode instance holds an arriving prefilled request that does not fit for up to S "
                         "seconds (re-checking every step) before refusing it; 0 = refuse at once")
    ap.add_argument("--decode-time", choices=["little", "mean"], default="little",
                    help="how the simulated shell measures the mean decode time t_d for prediction: little "
                         "(occupancy / completion rate) or mean (of completed decodes; biased low while filling)")
    ap.add_argument("--forecast", choices=["fluid", "age"], default="fluid",
                    help="prediction's forecast of running sequences: fluid (Little's law) or age (paper's wording: "
                         "gone t_d after they start)")
    ap.add_argument("--best-effort-when-idle", action="store_true",
                    help="admit a request whose own prefill misses the TTFT SLO even on an idle cluster when no "
                         "instance that may prefill has anything queued (the live conductor's default) instead of "
                         "refusing it")
    ap.add_argument("--oracle-lengths", action="store_true",
                    help="give the scheduler every request's true output length, so prediction forecasts decode "
                         "load per request (a perfect length predictor: an upper bound, not available live)")
    ap.add_argument("--max-tokens-known", action="store_true",
                    help="give the scheduler each request's max_tokens, taken to be its output length, as the live "
                         "conductor knows max_tokens (exact for outputs that run to their cap, as `mooncake bench` "
                         "sends them); only a cap, for the decode forecast and the stall rule of flexible roles")
    ap.add_argument("--no-pending-prefixes", action="store_true",
                    help="price a request only with prefixes already stored, not with those that prefills already "
                         "queued on the same instance will store first (the live router counts those)")
    ap.add_argument("--block-size", type=int, default=PAPER_BLOCK_SIZE, metavar="B",
                    help="tokens per trace hash_id block")
    ap.add_argument("--prefill-cache-blocks", type=int, default=None, metavar="K",
                    help="KVCache pool per prefill instance, in blocks of --block-size tokens (default: the "
                         "profile's room, converted from its own block size)")
    ap.add_argument("--decode-cache-blocks", type=int, default=None, metavar="K",
                    help="prefix blocks a decode instance keeps from prompts it prefilled itself (default: its whole "
                         "KV capacity in blocks)")
    ap.add_argument("--noise", type=float, default=0.1, metavar="SIGMA",
                    help="lognormal sigma of simulated durations around the estimators' predictions")
    ap.add_argument("--limit", type=int, default=None, metavar="N",
                    help="replay only the first N requests of the file (it is read no further, so a huge trace "
                         "starts at once)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the noise and of the random policy")
    ap.add_argument("--json", action="store_true", help="print one JSON object of summary metrics on stdout")
    ap.add_argument("--plot", type=pathlib.Path, default=None, metavar="DIR",
                    help="write ttft_cdf.png and load.png into DIR")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap


def warn_block_size(trace: list[TraceRecord], block_size: int) -> None:
    warning = block_size_warning(trace, block_size, "--block-size")
    if warning:
        print(f"mooncake sim: {warning}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.limit is not None and args.limit <= 0:
            raise ValueError("--limit must be positive")
        trace = load_trace(args.trace, limit=args.limit)
        profile = sim_profile(args.profile, args.fitted)
        sched = SchedulerConfig(policy=Policy(args.policy), admission=Admission(args.admission),
                                block_size=args.block_size, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                                kvcache_balancing_threshold=args.threshold,
                                conditional_disaggregation=not args.no_colocate,
                                colocate_max_new_tokens=args.colocate_max_tokens, seed=args.seed,
                                gate_kv_headroom=args.gate_headroom, decode_forecast=args.forecast,
                                decode_hold_s=args.decode_hold, best_effort_when_idle=args.best_effort_when_idle,
                                flexible_roles=args.flexible_roles, chunk_tokens=args.chunk_tokens)
        warn_block_size(trace, args.block_size)
        overrides = {"decode_time": args.decode_time, "oracle_lengths": args.oracle_lengths,
                     "max_tokens_known": args.max_tokens_known,
                     "pending_prefixes": not args.no_pending_prefixes}
        if args.prefill_cache_blocks is not None:
            overrides["prefill_cache_blocks"] = args.prefill_cache_blocks
        if args.decode_cache_blocks is not None:
            overrides["decode_cache_blocks"] = args.decode_cache_blocks
        res = simulate(trace, sched, profile, args.prefill, args.decode, args.speedup, args.noise, args.seed,
                       progress=not args.no_progress and sys.stderr.isatty(), **overrides)
    except (TraceError, ValueError, OSError) as exc:
        print(f"mooncake sim: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the replay broke its own invariants: a simulator bug, not bad input
        print(f"mooncake sim: error: the simulation failed: {exc} (a simulator bug; please report it with "
              f"the trace and the options)", file=sys.stderr)
        return 1
    status = 0
    summary = summarize(res, args.ttft_slo, args.tbt_slo)
    summary.update(policy=args.policy, admission=args.admission, speedup=args.speedup, prefill=args.prefill,
                   decode=args.decode, profile=profile.name)
    if args.plot is not None:
        from conductor.sim.plots import plot_load, plot_ttft_cdf

        label = f"{args.policy}/{args.admission} x{args.speedup:g}"
        try:
            args.plot.mkdir(parents=True, exist_ok=True)
            plot_ttft_cdf({label: res}, args.plot / "ttft_cdf.png", ttft_slo_s=args.ttft_slo)
            plot_load(res, args.plot / "load.png", label, args.ttft_slo, args.tbt_slo)
        except OSError as exc:  # the replay's numbers are still worth printing
            print(f"mooncake sim: error: cannot write plots to {args.plot}: {exc}", file=sys.stderr)
            status = 2
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:24s} {v:.4g}" if isinstance(v, float) else f"{k:24s} {v}")
    return status
