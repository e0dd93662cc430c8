"""Command-line options of the conductor's scheduling (shared by `serve` and `conductor`)."""

from __future__ import annotations

import argparse

from conductor.config import DEFAULT_PROFILE, live_scheduler_config
from conductor.core.config import Admission, Policy, SchedulerConfig
from conductor.slo import SLOBounds, parse_range, parse_slo_class
from mooncake import defaults


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduling")
    g.add_argument("--policy", choices=[p.value for p in Policy], default=Policy.KVCACHE_CENTRIC.value,
                   help="how the (prefill, decode) pair is chosen (default: kvcache-centric)")
    g.add_argument("--admission", choices=[a.value for a in Admission], default=Admission.PREDICTION.value,
                   help="overload admission: refuse early with 429 + Retry-After (default: prediction)")
    g.add_argument("--ttft-slo", type=float, default=defaults.TTFT_SLO_S, help="time-to-first-token SLO (seconds)")
    g.add_argument("--tbt-slo", type=float, default=defaults.TBT_SLO_S, help="time-between-tokens SLO (seconds)")
    g.add_argument("--balancing-threshold", type=float, default=defaults.BALANCING_THRESHOLD,
                   help="kvcache_balancing_threshold of Algorithm 1 (ratio >= 1): a worker considers fetching "
                        "another's prefix when it is at least this many times as long as its own")
    g.add_argument("--no-conditional-disaggregation", action="store_true",
                   help="never prefill on the decode instance itself")
    g.add_argument("--no-flexible-roles", action="store_true",
                   help="keep the workers' labels as fixed roles (prefill workers only prefill, decode workers "
                        "only decode); by default any worker may prefill or decode a request, its label only "
                        f"costs {defaults.ROLE_COST_S:g} s of predicted TTFT when broken (kvcache-centric only)")
    g.add_argument("--refuse-unattainable", action="store_true",
                   help="refuse (429, for good) a request whose own prefill takes longer than its TTFT SLO even "
                        "on an idle cluster; by default it is served, best effort, when no worker that may prefill "
                        "has anything queued, and refused with a Retry-After until then (unless it set its own, "
                        "tighter TTFT SLO)")
    g.add_argument("--no-retry-spacing", action="store_true",
                   help="tell each refused request the Retry-After of its own predicted drain, as if it were the "
                        "only one refused; by default requests refused together are told to come back one after "
                        "another, each a predicted share of the prefill (or decode) work of those before it "
                        "later, so that clients which obey Retry-After are not all refused again")
    g.add_argument("--remote-fetch", action=argparse.BooleanOptionalAction, default=defaults.REMOTE_FETCH,
                   help="Algorithm 1's fetch_from: a prefill worker may pull a longer prefix from another worker's "
                        "KVCache pool (priced with the measured KV bandwidth) instead of computing it, when that "
                        "predicts the lower TTFT; only workers whose pools serve other nodes (the default) are "
                        "fetched from. --no-remote-fetch prices each worker by the prefix it holds itself")
    g.add_argument("--profile", default=None,
                   help=f"estimator profile table: a bundled name or a JSON path (see `mooncake profile`); "
                        f"default: the bundled one measured in the workers' --dtype ({DEFAULT_PROFILE} for "
                        f"float32)")
    g.add_argument("--block-size", type=int, default=defaults.KV_BLOCK_SIZE,
                   help="KV block size in tokens (`serve` starts its workers with it; a conductor alone "
                        "routes only to workers of the same size)")
    g = parser.add_argument_group(
        "priority and SLO classes",
        "A request names a class with the header X-Mooncake-SLO-Class (else `default`: --ttft-slo, --tbt-slo, "
        "priority 0), and may set its own priority (body `priority` or X-Mooncake-Priority; lower is more "
        "important) and SLOs (X-Mooncake-SLO-TTFT-Ms, X-Mooncake-SLO-TBT-Ms, or body "
        "`mooncake_slo: {\"ttft_ms\": .., \"tbt_ms\": ..}`) within the bounds below (else 400). It is admitted "
        "by its own SLOs, less --priority-headroom of those of every more important class; metrics carry "
        "its class (label slo_class).")
    g.add_argument("--slo-class", action="append", default=[], metavar="NAME:TTFT_MS:TBT_MS:PRIORITY",
                   help="define an SLO class (repeatable), e.g. batch:30000:2000:10. Classes are not tied to API "
                        "keys: any client may name any class (X-Mooncake-SLO-Class), so define none more "
                        "important than default (priority below 0) unless every client is trusted. Priority "
                        "acts on admission only, not on the engines' queue order")
    g.add_argument("--priority-headroom", type=float, default=defaults.PRIORITY_HEADROOM, metavar="SHARE",
                   help="share of a more important class's TTFT and TBT SLOs, and of each decode worker's KV, that "
                        "a less important request may not use (default: %(default)s)")
    g.add_argument("--slo-ttft-range", default=None, metavar="MIN_MS:MAX_MS",
                   help=f"bounds of a request's own TTFT SLO (default: {defaults.SLO_TTFT_RANGE_S[0] * 1000:g}:"
                        f"--ttft-slo: tighter than the default class's, not looser, which would queue it ahead of "
                        f"everyone)")
    g.add_argument("--slo-tbt-range", default=None, metavar="MIN_MS:MAX_MS",
                   help=f"bounds of a request's own TBT SLO (default: --tbt-slo:"
                        f"{defaults.SLO_TBT_RANGE_S[1] * 1000:g}: looser than the default class's, not tighter, "
                        f"which would hold back its whole decode batch)")
    g.add_argument("--priority-range", default="%d:%d" % defaults.PRIORITY_RANGE, metavar="MIN:MAX",
                   help="bounds of a request's own priority (default: %(default)s: none more important than "
                        "the default class)")


def check_scheduler_args(args: argparse.Namespace) -> list[str]:
    """Options SchedulerConfig would refuse, as sentences, before anything starts."""
    if (error := defaults.block_size_error(args.block_size)) is not None:
        return [error]  # every worker would be refused: theirs is a multiple of 32 on vLLM-CPU
    try:
        scheduler_config(args)
        slo_bounds(args)
    except ValueError as exc:
        return [str(exc)]
    return []


def slo_bounds(args: argparse.Namespace) -> SLOBounds:
    """By default a request's own TTFT SLO may be tighter than the default class's and its TBT
    SLO looser (mooncake.defaults.SLO_*_RANGE_S), whatever --ttft-slo and --tbt-slo are."""
    ttft = ((min(defaults.SLO_TTFT_RANGE_S[0], args.ttft_slo), args.ttft_slo) if args.slo_ttft_range is None
            else _seconds(parse_range(args.slo_ttft_range, float, "--slo-ttft-range")))
    tbt = ((args.tbt_slo, max(defaults.SLO_TBT_RANGE_S[1], args.tbt_slo)) if args.slo_tbt_range is None
           else _seconds(parse_range(args.slo_tbt_range, float, "--slo-tbt-range")))
    return SLOBounds(ttft_s=ttft, tbt_s=tbt, priority=parse_range(args.priority_range, int, "--priority-range"))


def _seconds(ms: tuple[float, float]) -> tuple[float, float]:
    return ms[0] / 1000, ms[1] / 1000


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return live_scheduler_config(
        policy=args.policy, admission=args.admission, block_size=args.block_size, ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo, kvcache_balancing_threshold=args.balancing_threshold,
        conditional_disaggregation=not args.no_conditional_disaggregation,
        remote_fetch=args.remote_fetch, best_effort_when_idle=not args.refuse_unattainable,
        space_retries=not args.no_retry_spacing,
        # Flexible roles price every instance by TTFT, which only kvcache-centric does.
        flexible_roles=not args.no_flexible_roles and args.policy == Policy.KVCACHE_CENTRIC.value,
        # Each worker says its own tokens per step (in the registry and on /health); this prices
        # one that does not (an older worker) at the workers' default.
        chunk_tokens=getattr(args, "chunk_size", defaults.CHUNK_SIZE),
        slo_classes=tuple(parse_slo_class(spec) for spec in args.slo_class), priority_headroom=args.priority_headroom,
    )
