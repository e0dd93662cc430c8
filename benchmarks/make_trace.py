"""Write synthetic Mooncake-format traces with stated parameters (conductor.sim.trace.TraceParams).

  python benchmarks/make_trace.py --preset longgen --out benchmarks/out/longgen.jsonl

Presets:
  chat     4000 requests at 4 req/s; 200 shared prefixes (Zipf a=1.1, mean 12 blocks = 6k tokens);
           private suffix lognormal median 3k tokens (sigma 1); output lognormal median 300 (sigma 1).
           Prefill-bound like the released trace.
  longgen  3000 requests at 5 req/s; same prefixes; suffix median 3k; output lognormal median
           1500 tokens (sigma 0.6, cap 8192): long generations (reasoning, writing), so the decode
           pool's KV capacity is the bottleneck, the overload regime of paper section 6.
  coupled  12000 requests at 4 req/s (50 min; 25 min at 2x); 200 shared prefixes (Zipf a=1.1, mean
           16 blocks = 8k tokens); suffix lognormal median 5k tokens (sigma 1); output lognormal
           median 1200 tokens (sigma 0.7, cap 8192). Mean input 16.4k, mean output 1.5k. At 2x the
           offered prefill work is ~1.45x the prefill pool's capacity (8 nodes, infinite-cache
           estimate) and the offered decode KV-seconds ~1.7x the decode pool's: both pools are
           overloaded together, the regime of paper Table 2. Chosen for that property, not tuned
           for any policy's result.
A <out>.params.json file records the exact parameters next to the trace.
"""

from __future__ import annotations

import argparse
import sys

from conductor.sim.trace import TraceParams, generate_trace, write_trace

PRESETS = {
    "chat": TraceParams(n_requests=4000, rate_rps=4.0, output_median=300.0),
    "longgen": TraceParams(n_requests=3000, rate_rps=5.0, output_median=1500.0, output_sigma=0.6),
    "coupled": TraceParams(n_requests=12000, rate_rps=4.0, prefix_blocks_mean=16.0, suffix_tokens_median=5000.0,
                           output_median=1200.0, output_sigma=0.7),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="chat", help="workload preset")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    ap.add_argument("--out", required=True, help="output JSONL path")
    args = ap.parse_args(argv)
    params = PRESETS[args.preset]
    params = TraceParams(**{**{f: getattr(params, f) for f in params.__dataclass_fields__}, "seed": args.seed})
    rows = generate_trace(params)
    write_trace(rows, args.out, params)
    print(f"wrote {len(rows)} requests to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
