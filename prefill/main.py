"""`mooncake prefill`: a prefill worker. It computes prompts (reusing its prefix cache), chunked
by --chunk-size, and pushes each prompt's KV layer by layer to the decode worker the conductor
names in the request."""

from __future__ import annotations

import argparse

from mooncake.engine.cli import add_worker_arguments, worker_config

DEFAULT_PORT = 8100


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_arguments(parser, DEFAULT_PORT)


def run(args: argparse.Namespace, model_path: str) -> int:
    from mooncake.engine.runner import run_worker

    run_worker(worker_config(args, "prefill", model_path))
    return 0
