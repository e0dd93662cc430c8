"""What every worker of benchmarks/transfer_bench.py shares: the plan, the byte patterns that
prove the bytes arrived, the timing loop and the JSON lines a worker prints.

Stdlib and numpy only: the peers' workers run in their own virtualenvs (Mooncake's transfer
engine, NIXL) and import this file by path, never our packages.

A measurement is a pair of processes. The *target* registers a region, prints one JSON line
(`{"ready": ...}`: how to reach it), then waits for a line on stdin: "verify" makes it check
what the initiator wrote and print `{"verified": ...}`; end of input makes it exit. The
*initiator* registers its own region of the same size, reads the target's `ready` object from
its `--peer` argument, and for each op ("read", then "write") and slice size runs warm-up and
timed rounds, printing one JSON line per (op, size) and progress on stderr.

Layout in both regions: batch slot k (0 .. inflight-1), slice j (0 .. slices-1) of size s lives at
offset (k * slices + j) * s on both sides, so in-flight batches never touch the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

MiB = 1 << 20
# Patterns repeat with a prime period, so a slice landing at a wrong offset (any multiple of a
# power of two) never matches by accident.
PATTERN_PERIOD = 1_048_583
TARGET_SEED = 1
OPS = ("read", "write")


@dataclass(frozen=True)
class Plan:
    """What one measurement moves. Every field is set by transfer_bench.py's command line."""

    slice_sizes: tuple[int, ...] = (MiB, 16 * MiB)
    slices_per_batch: int = 8
    inflight: int = 4  # batches submitted before the oldest is awaited
    round_bytes: int = 512 * MiB  # bytes timed as one sample (at least `inflight` batches)
    rounds: int = 7  # timed samples per (op, size); the median is reported
    warmup_rounds: int = 1

    def batch_bytes(self, size: int) -> int:
        return self.slices_per_batch * size

    def batches_per_round(self, size: int) -> int:
        return max(self.inflight, math.ceil(self.round_bytes / self.batch_bytes(size)))

    def used_bytes(self, size: int) -> int:
        """Bytes of the region a measurement with slices of `size` touches."""
        return self.inflight * self.batch_bytes(size)

    def region_bytes(self) -> int:
        return max(self.used_bytes(s) for s in self.slice_sizes)

    def offsets(self, size: int, slot: int) -> list[int]:
        first = slot * self.slices_per_batch
        return [(first + j) * size for j in range(self.slices_per_batch)]

    def write_order(self) -> list[int]:
        """Largest first, so each later size overwrites a prefix the target can check."""
        return sorted(self.slice_sizes, reverse=True)

    def write_seed(self, size: int) -> int:
        return 100 + self.slice_sizes.index(size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        return cls(**{**raw, "slice_sizes": tuple(raw["slice_sizes"])})


def _pattern_block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, PATTERN_PERIOD, dtype=np.uint8)


def _chunks(start: int, end: int) -> Iterator[tuple[int, int]]:
    step = 16 * PATTERN_PERIOD
    first = start - start % PATTERN_PERIOD
    for lo in range(first, end, step):
        yield max(lo, start), min(lo + step, end)


def fill(region: np.ndarray, seed: int, start: int = 0, end: int | None = None) -> None:
    """Write the pattern of `seed` into region[start:end] (the pattern is anchored at offset 0)."""
    block = np.tile(_pattern_block(seed), 16)
    for lo, hi in _chunks(start, len(region) if end is None else end):
        base = lo - lo % PATTERN_PERIOD
        region[lo:hi] = block[lo - base:hi - base]


def matches(region: np.ndarray, seed: int, start: int = 0, end: int | None = None) -> bool:
    block = np.tile(_pattern_block(seed), 16)
    for lo, hi in _chunks(start, len(region) if end is None else end):
        base = lo - lo % PATTERN_PERIOD
        if not np.array_equal(region[lo:hi], block[lo - base:hi - base]):
            return False
    return True


def writes_landed(plan: Plan, region: np.ndarray) -> bool:
    """The target's check after every write measurement: each size's pattern where it was last written."""
    covered = 0
    for size in reversed(plan.write_order()):  # smallest (written last) first
        used = plan.used_bytes(size)
        if used > covered and not matches(region, plan.write_seed(size), covered, used):
            return False
        covered = max(covered, used)
    return True


def pipelined_round(submit: Callable[[int], object], wait: Callable[[object], None],
                    batches: int, inflight: int) -> None:
    """Submit `batches` batches, at most `inflight` outstanding; slot = batch index % inflight."""
    pending: deque = deque()
    for b in range(batches):
        if len(pending) == inflight:
            wait(pending.popleft())
        pending.append(submit(b % inflight))
    while pending:
        wait(pending.popleft())


# A transfer under test: run_round(op, size, batches) moves `batches` batches of slices of `size`
# between the two regions with the plan's pipelining and returns when all have landed.
RunRound = Callable[[str, int, int], None]


def measure(plan: Plan, label: str, local: np.ndarray, run_round: RunRound,
            emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Time every (op, size) of the plan; reads are checked against the target's pattern. The
    initiator's region holds each size's write pattern before its write rounds."""
    emit = emit or print_json
    results = []
    for op in OPS:
        sizes = plan.slice_sizes if op == "read" else plan.write_order()
        for size in sizes:
            used = plan.used_bytes(size)
            if op == "read":
                local[:used] = 0
            else:
                fill(local, plan.write_seed(size), 0, used)
            batches = plan.batches_per_round(size)
            nbytes = batches * plan.batch_bytes(size)
            samples = []
            for r in range(plan.warmup_rounds + plan.rounds):
                t0 = time.perf_counter()
                run_round(op, size, batches)
                seconds = time.perf_counter() - t0
                if r >= plan.warmup_rounds:
                    samples.append(nbytes / seconds / 1e9)
                progress(f"{label} {op} {size // MiB} MiB: round {r + 1}/{plan.warmup_rounds + plan.rounds}"
                         f" {nbytes / seconds / 1e9:.2f} GB/s")
            result = {"op": op, "slice_bytes": size, "gbps": samples,
                      "verified": matches(local, TARGET_SEED, 0, used) if op == "read" else None}
            emit(result)
            results.append(result)
    return results


def print_json(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def progress(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def serve_until_done(plan: Plan, region: np.ndarray) -> None:
    """The target's loop after `ready`: answer "verify" lines until stdin closes."""
    for line in sys.stdin:
        if line.strip() == "verify":
            print_json({"verified": writes_landed(plan, region)})


def worker_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("role", choices=("target", "initiator"))
    parser.add_argument("--plan", required=True, help="Plan as JSON (transfer_bench.py writes it)")
    parser.add_argument("--wire", default="tcp", help="which wire or transport to use")
    parser.add_argument("--peer", default=None, help="the target's `ready` object, as JSON (initiator)")
    parser.add_argument("--label", default="", help="name shown in progress lines")
    args = parser.parse_args()
    args.plan = Plan.from_json(args.plan)
    args.peer = json.loads(args.peer) if args.peer else None
    return args


def new_region(plan: Plan, seed: int | None) -> np.ndarray:
    """A page-aligned region of the plan's size, filled with `seed`'s pattern (or left zero)."""
    region = np.zeros(plan.region_bytes(), dtype=np.uint8)
    if seed is not None:
        fill(region, seed)
    return region
