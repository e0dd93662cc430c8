"""`mooncake decode`: a decode worker. It receives prompt KV pushed by prefill workers into its
DRAM staging area, loads it into its paged cache and continues the request in its continuous
batch. It can also run a request whole (colocated) when the conductor decides so."""

from __future__ import annotations

import argparse

from mooncake import defaults
from mooncake.defaults import WorkerRole
from mooncake.engine.cli import add_worker_arguments, check_worker_args, worker_config

DEFAULT_PORT = defaults.DECODE_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, DEFAULT_PORT)


def check(args: argparse.Namespace) -> list[str]:
    return check_worker_args(args)


def run(args: argparse.Namespace, model_path: str, pool_factory=None) -> int:
    from mooncake.engine.runner import run_worker

    return run_worker(worker_config(args, WorkerRole.DECODE, model_path), pool_factory)
