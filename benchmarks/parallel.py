"""Running a benchmark's independent replays in worker processes, with a progress line each."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Sequence
from typing import Any


def run_replays(fn: Callable[[Any], Any], tasks: Sequence[Any], jobs: int,
                describe: Callable[[Any], str]) -> list[Any]:
    """fn over tasks in `jobs` spawned processes (fresh interpreters: no state leaks between
    replays), results in completion order; prints "[n/N] describe(result)" on stderr as each ends."""
    results = []
    with multiprocessing.get_context("spawn").Pool(max(jobs, 1)) as pool:
        for n, result in enumerate(pool.imap_unordered(fn, tasks), 1):
            print(f"[{n}/{len(tasks)}] {describe(result)}", file=sys.stderr, flush=True)
            results.append(result)
    return results
