"""mooncake bench: a load generator for any OpenAI-compatible endpoint (ours, stock vLLM, ...).

Sends a workload (a Mooncake-format trace with real prefix sharing, generated prompts, or a
prompts file) on a Poisson or trace schedule at one rate or a sweep, streams every answer, and
reports TTFT, time between tokens, end-to-end latency, SLO attainment, goodput and SLO capacity.

  mooncake bench --url http://127.0.0.1:8000/v1 --num-requests 60 --input-len 1000-3000 \\
      --output-len 64 --rates 0.25,0.5,1 --out results.json --plot plots/
  mooncake bench --trace trace.jsonl --max-input-len 1900 --arrival trace --time-scale 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys
from collections.abc import Sequence

from mooncake import defaults
from mooncake.bench import report, workload
from mooncake.bench.runner import ClientOptions, EndpointError, make_client, preflight, run_schedule
from mooncake.bench.stats import RequestRecord, slo_capacity, summarize
from mooncake.cli_help import DefaultsHelpFormatter
from mooncake.paths import unusable_directory
from mooncake.trace import MAX_TOKENS, TraceError, block_size_warning, load_trace

WARMUP_SALT = 1_000_000  # run i uses salt i: warm-up prompts share no tokens with any measured run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=f"http://127.0.0.1:{defaults.CONDUCTOR_PORT}/v1",
                   help="the endpoint's OpenAI base URL (ending in /v1)")
    p.add_argument("--model", default=None, help="model name to ask for (default: the first the endpoint lists)")
    p.add_argument("--api-key", default="EMPTY", help="sent as `Authorization: Bearer KEY`")
    w = p.add_argument_group("workload (one of --trace, --prompts-file, or generated prompts)")
    w.add_argument("--trace", default=None, help="Mooncake-format JSONL trace (timestamp, input_length, "
                                                 "output_length, hash_ids)")
    w.add_argument("--trace-block-size", type=int, default=512,
                   help="tokens per trace hash id (512 in the released Mooncake trace)")
    w.add_argument("--max-input-len", type=int, default=None,
                   help="truncate prompts to this many tokens (a prompts file's text prompts are sent whole)")
    w.add_argument("--max-output-len", type=int, default=None, help="cap each request's output tokens")
    w.add_argument("--prompts-file", default=None, help='JSONL of {"prompt": str | [int], "max_tokens": int}')
    w.add_argument("--num-requests", type=int, default=None,
                   help="requests per rate (default: 100 generated; all lines of a trace or prompts file)")
    w.add_argument("--input-len", default="128-512", help="generated prompt length in tokens, MIN-MAX or N")
    w.add_argument("--output-len", type=int, default=64, help="generated requests' output tokens")
    w.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens at the start of every generated prompt that all share (0: none)")
    w.add_argument("--vocab-size", type=int, default=49152,
                   help=f"token ids are drawn from [{workload.LOW_TOKEN_ID}, this); 49152 is SmolLM2's")
    w.add_argument("--seed", type=int, default=0, help="seeds prompt lengths, tokens and Poisson arrivals (the same seed sends the "
                        "same token ids: change it between runs to meet a cold prefix cache)")
    w.add_argument("--reuse-prompts", action="store_true",
                   help="send the very same token ids at every rate (default: same shapes, fresh ids per "
                        "rate, so no rate is served from the cache an earlier rate warmed)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=("poisson", "trace"), default="poisson",
                   help="Poisson at --rate, or the trace's own timestamps")
    a.add_argument("--rate", type=float, default=1.0, help="offered rate in requests per second")
    a.add_argument("--rates", default=None, help="a sweep, e.g. 0.25,0.5,1.0 (each rate on the same workload)")
    a.add_argument("--time-scale", type=float, default=1.0,
                   help="with --arrival trace: multiply trace times by this (0.5 = twice as fast)")
    a.add_argument("--warmup", type=int, default=0,
                   help="requests sent before measuring: the run's first ones, at the first rate "
                        "(with --arrival trace: at the trace's timing)")
    c = p.add_argument_group("client")
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    c.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let generation stop at EOS (default: ignore_eos, so output lengths are exact)")
    c.add_argument("--retry-after", action="store_true",
                   help="retry a 429 after its Retry-After (latency still counts from the first attempt); "
                        "without it a 429 is a refusal")
    c.add_argument("--max-retry-wait", type=float, default=30.0,
                   help="seconds from a request's first send within which it may be retried (the 429 answers' "
                        "time counts too)")
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request's whole answer may take before it is an error")
    s = p.add_argument_group("SLO and output")
    s.add_argument("--ttft-slo", type=float, default=defaults.TTFT_SLO_S, help="TTFT SLO in seconds")
    s.add_argument("--tbt-slo", type=float, default=defaults.TBT_SLO_S,
                   help="SLO on a request's mean time between tokens, seconds")
    s.add_argument("--attainment-target", type=float, default=0.9,
                   help="SLO capacity is the highest offered rate with at least this attainment")
    s.add_argument("--out", default=None, help="write every request's record and the summaries to this JSON file")
    s.add_argument("--plot", default=None, help="write PNG plots (TTFT CDF, attainment and goodput vs rate) here")


def parse_input_len(text: str) -> tuple[int, int]:
    lo, dash, hi = text.partition("-")
    lo_n, hi_n = int(lo), int(hi if dash else lo)  # "3-" is refused (int("") raises), not read as 3
    if not 1 <= lo_n <= hi_n <= MAX_TOKENS:
        raise ValueError
    return lo_n, hi_n


def parse_rates(args: argparse.Namespace) -> list[float]:
    return [float(r) for r in args.rates.split(",")] if args.rates is not None else [args.rate]


def check(args: argparse.Namespace) -> list[str]:
    errors = []
    if args.trace and args.prompts_file:
        errors.append("give --trace or --prompts-file, not both")
    if args.arrival == "trace" and not args.trace:
        errors.append("--arrival trace needs --trace")
    if args.arrival == "trace" and args.rates:
        errors.append("--rates sweeps Poisson rates; with --arrival trace use --time-scale")
    try:
        parse_input_len(args.input_len)
    except ValueError:
        errors.append(f"--input-len must be N or MIN-MAX with 1 <= MIN <= MAX <= {MAX_TOKENS:,}, "
                      f"got {args.input_len!r}")
    try:
        rates = parse_rates(args)
        if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
            raise ValueError
    except ValueError:
        errors.append(f"rates must be positive numbers, got {args.rate if args.rates is None else args.rates!r}")
    for name in ("num_requests", "max_input_len", "max_output_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.output_len < 1 or args.trace_block_size < 1 or args.warmup < 0 or args.shared_prefix < 0:
        errors.append("--output-len and --trace-block-size must be >= 1, --warmup and --shared-prefix >= 0")
    if args.seed < 0:
        errors.append(f"--seed must be >= 0, got {args.seed}")
    if args.vocab_size <= workload.LOW_TOKEN_ID:
        errors.append(f"--vocab-size must exceed {workload.LOW_TOKEN_ID}")
    # Written as "not (in range)": nan fails every comparison, so it is refused with the rest.
    for flag, value in (("--time-scale", args.time_scale), ("--ttft-slo", args.ttft_slo),
                        ("--tbt-slo", args.tbt_slo)):
        if not (math.isfinite(value) and value > 0):
            errors.append(f"{flag} must be a finite number > 0, got {value:g}")
    if not (math.isfinite(args.max_retry_wait) and args.max_retry_wait >= 0):
        errors.append(f"--max-retry-wait must be a finite number of seconds >= 0, got {args.max_retry_wait:g}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        errors.append(f"--temperature must be a finite number >= 0, got {args.temperature:g}")
    if not 0 < args.attainment_target <= 1:
        errors.append(f"--attainment-target must be in (0, 1], got {args.attainment_target:g}")
    if not args.request_timeout > 0:
        errors.append(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
    # Checked now, not after a sweep of many minutes whose records would then be lost.
    if args.out:
        problem = ("it is a directory" if os.path.isdir(args.out)
                   else "the file is not writable" if os.path.exists(args.out) and not os.access(args.out, os.W_OK)
                   else unusable_directory(os.path.dirname(os.path.abspath(args.out)), create=False))
        if problem:
            errors.append(f"--out {args.out}: cannot write the results there: {problem}")
    if args.plot:
        problem = unusable_directory(args.plot)
        if problem:
            errors.append(f"--plot {args.plot}: cannot write plots there: {problem}")
    return errors


def build_specs(args: argparse.Namespace) -> list[workload.RequestSpec]:
    """The workload; raises TraceError (or PromptsFileError) naming file:line on bad input."""
    if args.trace:
        # --num-requests stops the reading too: the first N lines of a long trace start at once
        records = load_trace(args.trace, limit=args.num_requests)
        warning = block_size_warning(records, args.trace_block_size, "--trace-block-size")
        if warning:  # its hash_ids would name the wrong token spans: the prefix sharing built is wrong
            print(f"mooncake bench: {warning}", file=sys.stderr)
        specs = workload.trace_specs(records, max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    elif args.prompts_file:
        specs = workload.load_prompts_file(args.prompts_file, max_input_len=args.max_input_len,
                                           max_output_len=args.max_output_len)
        if len(parse_rates(args)) > 1 or args.warmup:
            print("mooncake bench: note: a prompts file's prompts are sent as written at every rate and in the "
                  "warm-up, so a server's prefix cache serves later runs from earlier ones", file=sys.stderr)
    else:
        specs = workload.generated_specs(args.num_requests or 100, parse_input_len(args.input_len),
                                         args.output_len, args.seed, args.shared_prefix)
    return specs[:args.num_requests] if args.num_requests else specs


class _Prompts(Sequence):
    """A run's prompts, each built when its request is due: a long trace's token-id prompts built
    all at once held gigabytes (about 40 bytes a token as Python ints)."""

    def __init__(self, args, specs, salt: int):
        self._args, self._specs, self._salt = args, specs, salt

    def __len__(self) -> int:
        return len(self._specs)

    def __getitem__(self, i):
        a = self._args
        return workload.prompt_of(self._specs[i], block_size=a.trace_block_size, vocab_size=a.vocab_size,
                                  seed=a.seed, salt=self._salt)


def _records(specs, offsets, warmup: bool = False) -> list[RequestRecord]:
    return [RequestRecord(s.index, s.input_length, s.max_tokens, off, warmup=warmup) for s, off in zip(specs, offsets)]


def context_warning(specs: list[workload.RequestSpec], context: int | None) -> str | None:
    """Said before sending: requests longer than the model's context, which the server refuses (400)
    and the figures count as errors."""
    if context is None:
        return None
    over = [s for s in specs if s.input_length + s.max_tokens > context]
    if not over:
        return None
    longest = max(s.input_length + s.max_tokens for s in over)
    return (f"{len(over)} of {len(specs)} requests need more than the model's context of {context:,} tokens "
            f"(prompt + output up to {longest:,}): the server will refuse them, and they count as errors; "
            f"--max-input-len and --max-output-len cap the lengths")


LONG_REPLAY_S = 3600.0  # a trace replay longer than this is said before it starts


@dataclasses.dataclass
class SweepResults:
    """What a sweep measured so far (kept by the caller, so an interrupted sweep keeps its rates)."""

    model: str = ""
    warm: list[RequestRecord] = dataclasses.field(default_factory=list)
    runs: list[tuple] = dataclasses.field(default_factory=list)  # (RateSummary, its records), finished rates


async def sweep(args: argparse.Namespace, specs: list[workload.RequestSpec], results: SweepResults) -> None:
    """Preflight, warm-up, then one run per rate, each added to `results` once it finished."""
    opts = ClientOptions(args.url, args.model or "", args.api_key, args.temperature, args.ignore_eos,
                         args.retry_after, args.max_retry_wait, args.request_timeout)
    client = make_client(opts)
    try:
        model, context = await preflight(client, args.model)
        results.model = model
        warning = context_warning(specs, context)
        if warning:
            print(f"mooncake bench: warning: {warning}", file=sys.stderr)
        opts = dataclasses.replace(opts, model=model)
        rates = parse_rates(args)
        if args.warmup:
            w_specs = specs[:args.warmup]
            w_offsets = (workload.trace_offsets(w_specs, args.time_scale) if args.arrival == "trace"
                         else workload.poisson_offsets(len(w_specs), rates[0], args.seed + 1))
            results.warm = _records(w_specs, w_offsets, warmup=True)
            await run_schedule(client, opts, _Prompts(args, w_specs, WARMUP_SALT), results.warm, "warm-up")
        for i, rate in enumerate(rates):
            if args.arrival == "trace":
                offsets = workload.trace_offsets(specs, args.time_scale)
                offered = workload.offered_rate(offsets)
            else:
                offsets, offered = workload.poisson_offsets(len(specs), rate, args.seed), rate
            recs = _records(specs, offsets)
            await run_schedule(client, opts, _Prompts(args, specs, 0 if args.reuse_prompts else i), recs,
                               f"{offered:.3g} req/s")
            results.runs.append((summarize(recs, offered, args.ttft_slo, args.tbt_slo), recs))
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake bench", description=__doc__, formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    errors = check(args)
    if errors:
        parser.error("; ".join(errors))
    try:
        specs = build_specs(args)
    except (TraceError, OSError) as exc:
        print(f"mooncake bench: {exc}", file=sys.stderr)
        return 2
    if args.arrival == "trace":
        span = max(workload.trace_offsets(specs, args.time_scale), default=0.0)
        if span > LONG_REPLAY_S:
            print(f"mooncake bench: warning: replaying the trace's timing takes {span / 3600:,.1f} hours per "
                  f"rate (--time-scale shrinks it; timestamps must be in ms)", file=sys.stderr)
    else:
        span = sum(max(workload.poisson_offsets(len(specs), rate, args.seed), default=0.0) for rate in parse_rates(args))
        if span > LONG_REPLAY_S:
            print(f"mooncake bench: warning: sending {len(specs)} requests at each rate takes {span / 3600:,.1f} "
                  f"hours in all (fewer --num-requests, or higher rates, take less)", file=sys.stderr)
    results = SweepResults(model=args.model or "")
    interrupted = False
    try:
        asyncio.run(sweep(args, specs, results))
    except EndpointError as exc:
        print(f"mooncake bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: report the rates that finished, drop the one under way
        interrupted = True
        print(f"\nmooncake bench: interrupted; reporting the {len(results.runs)} rate(s) that finished",
              file=sys.stderr)
        if not results.runs:
            return 130
    model, warm, runs = results.model, results.warm, results.runs
    summaries = [s for s, _ in runs]
    capacity = slo_capacity(summaries, args.attainment_target)
    print(f"model {model} at {args.url}; SLO: TTFT <= {args.ttft_slo} s, mean TBT <= {args.tbt_slo} s; "
          f"{len(specs)} requests per rate")
    print(report.table(summaries, capacity, args.attainment_target))
    for line in report.error_lines(runs):
        print(line)
    # Checked before the sweep, but a disk can fill or a file change meanwhile: each output is
    # tried on its own, so one that fails loses neither the other nor the printed table.
    unwritten = False
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "api_key"} | {"model": model}
        try:
            report.write_json(args.out, config, runs, warm, capacity)
        except OSError as exc:
            unwritten = True
            print(f"mooncake bench: could not write --out {args.out}: {exc}", file=sys.stderr)
    if args.plot:
        try:
            for path in report.write_plots(args.plot, runs, args.ttft_slo, args.attainment_target):
                print(f"wrote {path}")
        except OSError as exc:
            unwritten = True
            print(f"mooncake bench: could not write --plot {args.plot}: {exc}", file=sys.stderr)
    if interrupted:
        return 130
    if unwritten:
        return 1
    # Refusals and slow answers are results; only a sweep in which every request failed is not.
    return 3 if all(s.errors == s.requests for s in summaries) else 0
