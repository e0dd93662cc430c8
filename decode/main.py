"""`mooncake decode`: a decode worker. It receives prompt KV pushed by prefill workers into its
DRAM staging area, loads it into its paged cache and continues the request in its continuous
batch. It can also run a request whole (colocated) when the conductor decides so."""

from __future__ import annotations

import argparse

from mooncake.engine.cli import add_worker_arguments, worker_config

DEFAULT_PORT = 8200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, DEFAULT_PORT)


def run(args: argparse.Namespace, model_path: str) -> int:
    from mooncake.engine.runner import run_worker

    run_worker(worker_config(args, "decode", model_path))
    return 0
