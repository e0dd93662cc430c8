"""Mooncake-format traces: a synthetic generator with stated parameters.

The format itself (TraceError, TraceRecord, load_trace) lives in the base, mooncake/trace.py,
because `mooncake bench` reads it too; it is re-exported here for the simulator's callers.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import asdict, dataclass

import numpy as np

from mooncake.trace import (TraceError, TraceRecord, block_count_mismatches, fitting_block_sizes,  # noqa: F401
                            load_trace, parse_line)


# -- generator --------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceParams:
    """A workload of shared prefixes (system prompts, documents, earlier turns) plus a
    private suffix per request, arriving as a Poisson process."""

    n_requests: int = 4000
    """Number of requests."""
    rate_rps: float = 4.0
    """Mean arrival rate (Poisson), requests per second."""
    n_prefixes: int = 200
    """Distinct shared prefixes."""
    zipf_a: float = 1.1
    """Popularity of prefixes: prefix k is chosen with probability ~ 1/k^a."""
    prefix_blocks_mean: float = 12.0
    """Mean shared prefix length in blocks (geometric)."""
    suffix_tokens_median: float = 3000.0
    """Median private suffix length in tokens (lognormal)."""
    suffix_sigma: float = 1.0
    """Lognormal sigma of the suffix length."""
    output_median: float = 300.0
    """Median output length in tokens (lognormal)."""
    output_sigma: float = 1.0
    """Lognormal sigma of the output length."""
    rate_amplitude: float = 0.0
    """Relative swing of the arrival rate: rate(t) = rate_rps * (1 + A*sin(2*pi*t/period)).
    0 = a homogeneous Poisson process (and the very same trace as before this option existed)."""
    rate_period_s: float = 600.0
    """Period of that swing, seconds of trace time (busy and quiet phases, as in real traffic)."""
    max_output: int = 8192
    max_input: int = 131072
    block_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_requests <= 0 or self.rate_rps <= 0 or self.n_prefixes <= 0 or self.block_size <= 0:
            raise ValueError("n_requests, rate_rps, n_prefixes and block_size must be positive")
        if self.zipf_a <= 0 or self.prefix_blocks_mean < 1 or self.suffix_tokens_median < 1 or self.output_median < 1:
            raise ValueError("zipf_a > 0, prefix_blocks_mean >= 1, suffix/output medians >= 1 required")
        if not 0.0 <= self.rate_amplitude < 1.0 or self.rate_period_s <= 0:
            raise ValueError("need 0 <= rate_amplitude < 1 and rate_period_s > 0")


def _modulate(times: np.ndarray, p: TraceParams) -> np.ndarray:
    """Time-rescale homogeneous Poisson arrivals into ones with rate(t) = r(1 + A sin(2 pi t/P)):
    an arrival at homogeneous time T lands at t with Lambda(t) = r*T, where Lambda is the
    integrated rate (monotone, so inverted by interpolation on a fine grid)."""
    if p.rate_amplitude == 0.0 or len(times) == 0:
        return times
    a, period = p.rate_amplitude, p.rate_period_s
    grid = np.linspace(0.0, times[-1] / (1.0 - a) + period, 200_000)
    integrated = grid + a * period / (2 * math.pi) * (1.0 - np.cos(2 * math.pi * grid / period))
    return np.interp(times, integrated, grid)


def generate_trace(p: TraceParams) -> list[dict]:
    rng = np.random.default_rng(p.seed)
    prefix_len = rng.geometric(1.0 / p.prefix_blocks_mean, size=p.n_prefixes)
    next_id = 0
    prefixes: list[list[int]] = []
    for n in prefix_len:
        prefixes.append(list(range(next_id, next_id + int(n))))
        next_id += int(n)
    weights = 1.0 / np.arange(1, p.n_prefixes + 1) ** p.zipf_a
    choice = rng.choice(p.n_prefixes, size=p.n_requests, p=weights / weights.sum())
    gaps = rng.exponential(1.0 / p.rate_rps, size=p.n_requests)
    times = _modulate(np.cumsum(gaps) - gaps[0], p)
    suffix = rng.lognormal(math.log(p.suffix_tokens_median), p.suffix_sigma, size=p.n_requests)
    out = rng.lognormal(math.log(p.output_median), p.output_sigma, size=p.n_requests)
    rows = []
    for i in range(p.n_requests):
        pre = prefixes[choice[i]]
        length = min(len(pre) * p.block_size + max(int(suffix[i]), 1), p.max_input)
        n_blocks = math.ceil(length / p.block_size)
        ids = pre[:n_blocks] + list(range(next_id, next_id + max(n_blocks - len(pre), 0)))
        next_id += max(n_blocks - len(pre), 0)
        rows.append({"timestamp": int(times[i] * 1000), "input_length": int(length),
                     "output_length": int(min(max(out[i], 1), p.max_output)), "hash_ids": ids})
    return rows


def records_of(rows: list[dict]) -> list[TraceRecord]:
    """Generated rows as the records load_trace would give (line numbers from 1), without a file."""
    return [TraceRecord(n, float(r["timestamp"]), r["input_length"], r["output_length"], tuple(r["hash_ids"]))
            for n, r in enumerate(rows, start=1)]


def write_trace(rows: list[dict], path: str | pathlib.Path, params: TraceParams | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if params is not None:
        pathlib.Path(str(path) + ".params.json").write_text(json.dumps(asdict(params), indent=1) + "\n")
