"""Command-line options of the conductor's scheduling (shared by `serve` and `conductor`)."""

from __future__ import annotations

import argparse

from conductor.config import DEFAULT_PROFILE, live_scheduler_config
from conductor.core.config import Admission, Policy, SchedulerConfig
from mooncake import defaults


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling")
    g.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.KVCACHE_CENTRIC.value,
                   help="how the (prefill, decode) pair is chosen (default: kvcache-centric)")
    g.add_argument("--admission", choices=[a.value for a in Admission], default=Admission.PREDICTION.value,
                   help="overload admission: refuse early with 429 + Retry-After (default: prediction)")
    g.add_argument("--ttft-slo", type=float, default=defaults.TTFT_SLO_S, help="time-to-first-token SLO (seconds)")
    g.add_argument("--tbt-slo", type=float, default=defaults.TBT_SLO_S, help="time-between-tokens SLO (seconds)")
    g.add_argument("--balancing-threshold", type=float, default=1.5,
                   help="kvcache_balancing_threshold of Algorithm 1 (ratio >= 1)")
    g.add_argument("--no-conditional-disaggregation", action="store_true",
                   help="never prefill on the decode instance itself")
    g.add_argument("--no-flexible-roles", action="store_true",
                   help="keep the workers' labels as fixed roles (prefill workers only prefill, decode workers "
                        "only decode); by default any worker may prefill or decode a request, its label only "
                        f"costs {defaults.ROLE_COST_S:g} s of predicted TTFT when broken (kvcache-centric only)")
    g.add_argument("--profile", default=None,
                   help=f"estimator profile table: a bundled name or a JSON path (see `mooncake profile`); "
                        f"default: the bundled one measured in the workers' --dtype ({DEFAULT_PROFILE} for "
                        f"float32)")
    g.add_argument("--block-size", type=int, default=defaults.KV_BLOCK_SIZE,
                   help="KV block size in tokens; must equal the workers'")


def check_scheduler_args(args: argparse.Namespace) -> list[str]:
    """Options SchedulerConfig would refuse, as sentences, before anything starts."""
    if args.block_size <= 0 or args.block_size % defaults.BLOCK_SIZE_MULTIPLE:
        # Every worker would be refused: theirs is a multiple of 32 on vLLM-CPU.
        return [f"--block-size must be a positive multiple of {defaults.BLOCK_SIZE_MULTIPLE} (the workers' "
                f"KV block size on vLLM-CPU), got {args.block_size}"]
    try:
        scheduler_config(args)
    except ValueError as exc:
        return [str(exc)]
    return []


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return live_scheduler_config(
        policy=args.policy, admission=args.admission, block_size=args.block_size, ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo, kvcache_balancing_threshold=args.balancing_threshold,
        conditional_disaggregation=not args.no_conditional_disaggregation,
        # Flexible roles price every instance by TTFT, which only kvcache-centric does.
        flexible_roles=not args.no_flexible_roles and args.policy == Policy.KVCACHE_CENTRIC.value,
        # `serve` starts the workers with --chunk-size; a standalone conductor assumes their default.
        chunk_tokens=getattr(args, "chunk_size", defaults.CHUNK_SIZE),
    )
