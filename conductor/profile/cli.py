"""`mooncake profile --model PATH --out TABLE.json`: time a real vLLM engine.

Prefill rows: for each prompt length L and cached share, a warm-up request holding the first p
tokens puts them in vLLM's prefix cache, then the full prompt runs with max_tokens=1; the row is
(L, p, wall seconds). Every case uses fresh random tokens, so nothing else is cached.
Decode rows: a batch of b prompts of c tokens runs with max_tokens=1 and with max_tokens=N
(ignore_eos); the step time is the difference / (N-1), at KV = b*(c + N/2) tokens.
This is the shell around the pure estimators: it may read clocks and start processes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time
from collections.abc import Callable

from conductor.core.profile_table import DecodeRow, PrefillRow, ProfileTable, save_profile
from mooncake import defaults
from mooncake.cli_help import DefaultsHelpFormatter
from mooncake.defaults import Dtype
from mooncake.model_fit import kv_bytes_per_token, model_fit_errors
from mooncake.paths import unusable_directory



def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake profile", description=__doc__,
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", required=True, type=pathlib.Path, help="model folder (safetensors + config.json)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("profile.json"), help="profile table to write")
    ap.add_argument("--name", default=None,
                    help="table name (default: model folder name + '-cpu' + the dtype's suffix, e.g. -bf16)")
    ap.add_argument("--dtype", default=str(defaults.DTYPE), choices=[str(d) for d in Dtype],
                    help="weights and KV dtype of the engine; measure in the dtype the cluster will run "
                         "(`mooncake serve --dtype`) and give the table to the conductor with --profile PATH "
                         "(by itself it picks only the bundled tables measured in its --dtype)")
    ap.add_argument("--prompt-lengths", type=_list_of(int), default="256,512,1024,2048",
                    help="comma-separated prompt lengths")
    ap.add_argument("--cached-shares", type=_list_of(float), default="0,0.5,0.75",
                    help="comma-separated cached-prefix shares")
    ap.add_argument("--batch-sizes", type=_list_of(int), default="1,4,16", help="comma-separated decode batch sizes")
    ap.add_argument("--contexts", type=_list_of(int), default="128,1024", help="comma-separated decode context lengths")
    ap.add_argument("--decode-tokens", type=int, default=24, help="tokens generated per decode measurement")
    ap.add_argument("--block-size", type=int, default=128,
                    help="vLLM KV block size (the CPU attention backend needs a multiple of 32)")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for the engine")
    ap.add_argument("--bandwidth", type=float, default=3e8,
                    help="bytes/s recorded for KV transfers (default: 3e8, 300 MB/s)")
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats per point; the minimum is kept")
    return ap


def _list_of(kind: type) -> Callable[[str], list]:
    """argparse type: a non-empty comma-separated list (argparse also converts the defaults)."""
    def parse(s: str) -> list:
        try:
            values = [kind(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of {kind.__name__}") from None
        if not values:
            raise argparse.ArgumentTypeError("the list is empty")
        return values
    return parse


def table_name(model: pathlib.Path, dtype: Dtype) -> str:
    """The default table name: the one the conductor looks up for a cluster of this dtype
    (mooncake.defaults.profile_name), e.g. smollm2-135m-cpu-bf16."""
    return defaults.profile_name(f"{model.name.lower()}-cpu", dtype)


def option_errors(args: argparse.Namespace) -> list[str]:
    """What is wrong with the options, as sentences: checked before minutes of measuring, not by
    the fit or the write at the end."""
    errors = []
    if len(args.prompt_lengths) * len(args.cached_shares) < 4 or len(args.batch_sizes) * len(args.contexts) < 3:
        errors.append("the fit needs >= 4 prefill points (lengths x shares) and >= 3 decode points "
                      "(batch sizes x contexts)")
    if min(args.prompt_lengths) < 1 or min(args.batch_sizes) < 1 or min(args.contexts) < 1:
        errors.append("--prompt-lengths, --batch-sizes and --contexts must be positive")
    if not all(0 <= share < 1 for share in args.cached_shares):
        errors.append("--cached-shares must each be in [0, 1)")
    if args.decode_tokens < 2 or args.repeats < 1:
        errors.append("--decode-tokens must be >= 2 (a step is a difference) and --repeats >= 1")
    if (error := defaults.block_size_error(args.block_size)) is not None:
        errors.append(error)
    if args.kv_cache_gib < 1:
        errors.append(f"--kv-cache-gib must be >= 1 (VLLM_CPU_KVCACHE_SPACE is whole GiB), got {args.kv_cache_gib}")
    if not (math.isfinite(args.bandwidth) and args.bandwidth > 0):
        errors.append(f"--bandwidth must be a positive number of bytes per second, got {args.bandwidth}")
    if args.out.is_dir():
        errors.append(f"--out {args.out} is a directory: name the profile file to write")
    elif (error := unusable_directory(str(args.out.parent), create=False)) is not None:
        errors.append(f"--out {args.out}: {error}")
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if errors := option_errors(args):
        ap.error("; ".join(errors))
    try:
        cfg = json.loads((args.model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        ap.error(f"--model must be a Hugging Face model folder with a config.json: {exc}")
    dtype = Dtype(args.dtype)
    kv_bpt = kv_bytes_per_token(cfg, dtype)
    if kv_bpt is None:
        ap.error(f"--model {args.model}: its config.json does not say its layers, KV heads and head size")
    max_len = max(max(args.prompt_lengths), max(args.contexts) + args.decode_tokens) + args.block_size
    length_is = "the longest sequence asked for (--prompt-lengths, or --contexts + --decode-tokens, plus a block)"
    if errors := model_fit_errors(str(args.model), max_len, args.kv_cache_gib, str(dtype), length_is):
        ap.error("; ".join(errors))
    # The table's KV capacity is computed from --kv-cache-gib, so the engine gets exactly that
    # (before vllm is imported), whatever the environment said.
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if space not in (None, str(args.kv_cache_gib)):
        print(f"VLLM_CPU_KVCACHE_SPACE={space} in the environment is replaced by --kv-cache-gib "
              f"{args.kv_cache_gib}", file=sys.stderr)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), enforce_eager=True, dtype=str(dtype), enable_prefix_caching=True,
              max_model_len=max_len, block_size=args.block_size, max_num_seqs=max(args.batch_sizes))
    rng = random.Random(0)
    vocab = cfg["vocab_size"]

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 1) for _ in range(n)]

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return time.perf_counter() - t

    run([toks(64)], 2)  # warm up kernels
    prefill: list[PrefillRow] = []
    for length in args.prompt_lengths:
        for share in args.cached_shares:
            cached = int(length * share) // args.block_size * args.block_size
            best = float("inf")
            for _ in range(args.repeats):
                prompt = toks(length)
                if cached:
                    run([prompt[:cached]], 1)
                best = min(best, run([prompt], 1))
            prefill.append(PrefillRow(length, cached, round(best, 6)))
            print(f"prefill L={length} cached={cached}: {best:.4f} s", file=sys.stderr, flush=True)
    decode: list[DecodeRow] = []
    n = args.decode_tokens
    for b in args.batch_sizes:
        for ctx in args.contexts:
            t1 = min(run([toks(ctx) for _ in range(b)], 1) for _ in range(args.repeats))
            tn = min(run([toks(ctx) for _ in range(b)], n) for _ in range(args.repeats))
            step = max((tn - t1) / (n - 1), 1e-6)
            decode.append(DecodeRow(b, b * (ctx + n // 2), round(step, 6)))
            print(f"decode b={b} ctx={ctx}: {step * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
    capacity = int(args.kv_cache_gib * 2**30 / kv_bpt)
    table = ProfileTable(
        name=args.name or table_name(args.model, dtype), model=args.model.name,
        hardware=f"vLLM-CPU, {_cores()}, {dtype}, enforce_eager", source="measured",
        block_size=args.block_size, kv_bytes_per_token=kv_bpt, decode_kv_capacity_tokens=capacity,
        prefill_cache_blocks=capacity // args.block_size, bandwidth_Bps=args.bandwidth,
        prefill=tuple(prefill), decode=tuple(decode),
        assumptions={"dtype": str(dtype), "kv_cache_gib": args.kv_cache_gib, "decode_tokens": n,
                     "repeats": args.repeats,
                     "timing": "wall clock of LLM.generate, minimum of repeats"})
    save_profile(table, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cores() -> str:
    """The cores the engine ran on: the binding a worker would get, if one was given."""
    bound = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    return f"cores {bound} (VLLM_CPU_OMP_THREADS_BIND)" if bound else f"{os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
