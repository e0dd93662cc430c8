"""`mooncake prefill`: a prefill worker. It computes prompts (reusing its prefix cache), chunked
by --chunk-size, and pushes each prompt's KV layer by layer to the decode worker the conductor
names in the request."""

from __future__ import annotations

import argparse

from mooncake import defaults
from mooncake.defaults import WorkerRole
from mooncake.engine.cli import add_worker_arguments, check_worker_args, worker_config

DEFAULT_PORT = defaults.PREFILL_PORT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, DEFAULT_PORT)


def check(args: argparse.Namespace) -> list[str]:
    return check_worker_args(args)


def run(args: argparse.Namespace, model_path: str, pool_factory=None) -> int:
    from mooncake.engine.runner import run_worker

    return run_worker(worker_config(args, WorkerRole.PREFILL, model_path), pool_factory)
