"""The `mooncake` command line.

  mooncake serve          the embedded single-machine cluster: conductor + workers
  mooncake prefill        one prefill worker (for multi-host clusters)
  mooncake decode         one decode worker
  mooncake conductor      the OpenAI-compatible API server alone, pointed at workers
  mooncake prepare-model  convert the default model to safetensors (done by serve when needed)
  mooncake sim            replay a trace through the scheduler in a simulated cluster
  mooncake profile        measure the real engine and write the scheduler's profile table
  mooncake bench          load-test any OpenAI-compatible endpoint: latency, SLO attainment, goodput
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from mooncake import defaults
from mooncake.cli_help import DefaultsHelpFormatter
from mooncake.defaults import Dtype, chunk_size_error, engine_option_errors, max_model_len_error
from mooncake.logs import configure_logging, uvicorn_log_config


def _resolve_model(path: str | None) -> str:
    from mooncake.model import ensure_model

    return path or str(ensure_model())


def _unfit_model(command: str, model: str, args: argparse.Namespace, kv_cache: bool = True) -> bool:
    """Say so (and True) when the options cannot run this model (mooncake/model_fit.py)."""
    from mooncake.model_fit import cpu_engine, model_fit_errors

    kv_cache_gib = args.kv_cache_gib if kv_cache and cpu_engine() else None
    errors = model_fit_errors(model, args.max_model_len, kv_cache_gib, args.dtype)
    for error in errors:
        print(f"mooncake {command}: error: {error}", file=sys.stderr)
    return bool(errors)


def _missing_model(command: str, path: str | None) -> bool:
    """Say so (and True) when --model names no model folder. Checked when starting, not in the
    option check: the path is this machine's (a deployment's command lines are checked elsewhere)."""
    if path is not None and not (Path(path) / "config.json").is_file():
        print(f"mooncake {command}: error: --model {path}: not a model folder (no config.json there)", file=sys.stderr)
        return True
    return False


def _cmd_serve(args: argparse.Namespace) -> int:
    from conductor.auth import load_api_keys
    from conductor.cli_args import scheduler_config, slo_bounds
    from mooncake.auth import token_from_args
    from mooncake.engine.cli import pool_arguments
    from mooncake.launcher import ClusterConfig, serve
    from mooncake.supervisor import RestartPolicy

    busy = _busy_ports(args)
    if busy:
        print(f"mooncake serve: error: {busy}", file=sys.stderr)
        return 2
    model = _resolve_model(args.model)
    if _unfit_model("serve", model, args):
        return 2
    return serve(ClusterConfig(
        model_path=model, served_model_name=args.served_model_name or Path(model).name, host=args.host,
        port=args.port, num_prefill=args.prefill, num_decode=args.decode, first_worker_port=args.worker_port,
        dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
        chunk_size=args.chunk_size, decode_chunk_size=args.decode_chunk_size,
        api_keys=load_api_keys(args.api_keys_file, args.api_key),
        cluster_token=token_from_args(args), scheduler=scheduler_config(args), profile=args.profile,
        slo_bounds=slo_bounds(args), pool_args=pool_arguments(args),
        restart_policy=RestartPolicy(max_restarts=args.max_worker_restarts),
    ))


def _check_serve(args: argparse.Namespace) -> list[str]:
    from conductor.cli_args import check_scheduler_args

    errors = engine_option_errors(args.kv_cache_gib, args.block_size, args.chunk_size)
    if args.decode_chunk_size is not None and (
            error := chunk_size_error(args.decode_chunk_size, "--decode-chunk-size")) is not None:
        errors.append(error)
    errors += [e for e in check_scheduler_args(args) if e not in errors]
    if error := max_model_len_error(args.max_model_len):
        errors.append(error)
    if args.max_worker_restarts < 0:
        errors.append(f"--max-worker-restarts must be >= 0, got {args.max_worker_restarts}")
    if args.prefill < 0 or args.decode < 1:
        errors.append("a cluster needs --decode >= 1 and --prefill >= 0")
    else:
        errors += _port_errors(args)
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        errors.append(f"--model {args.model}: not a model folder (no config.json there)")
    from mooncake.engine.cli import pool_errors

    return errors + pool_errors(args) + _auth_errors(args) + _profile_errors(args)


def _worker_ports(args: argparse.Namespace) -> range:
    return range(args.worker_port, args.worker_port + args.prefill + args.decode)


def _port_errors(args: argparse.Namespace) -> list[str]:
    """The conductor's and the workers' ports: real ones (0 would make the OS pick one that
    nobody else learns) and apart."""
    workers = _worker_ports(args)
    if not 1 <= args.port <= 65535:
        return [f"--port must be in 1..65535, got {args.port}"]
    if not (1 <= workers.start and workers.stop - 1 <= 65535):
        return [f"--worker-port {args.worker_port}: the workers' ports {workers.start}..{workers.stop - 1} must lie "
                f"in 1..65535"]
    if args.port in workers:
        return [f"--port {args.port} is one of the workers' ports ({workers.start}..{workers.stop - 1}, from "
                f"--worker-port): give another"]
    return []


def _busy_ports(args: argparse.Namespace) -> str | None:
    """Why serve cannot start now (ports another process holds), told before any engine loads;
    None when they are free. Run when starting, not in the option check: it depends on the
    machine at that moment, not on the options."""
    from mooncake.net import host_error, port_in_use

    if problem := host_error(args.host):  # every port of it would look taken
        return f"--host {problem}"
    busy = [f"{port} ({'conductor' if port == args.port else 'worker'})"
            for host, port in [(args.host, args.port), *(("127.0.0.1", p) for p in _worker_ports(args))]
            if port_in_use(host, port)]
    return (f"port(s) already in use: {', '.join(busy)}; stop what holds them or pick others (--port, "
            f"--worker-port)") if busy else None


def _check_conductor(args: argparse.Namespace) -> list[str]:
    from conductor.cli_args import check_scheduler_args
    from mooncake.engine.cli import registry_errors

    errors = check_scheduler_args(args) + _auth_errors(args) + registry_errors(args)
    if not 0 <= args.drain_timeout < math.inf:
        errors.append(f"--drain-timeout must be >= 0 seconds and finite, got {args.drain_timeout:g}")
    if not 1 <= args.port <= 65535:
        errors.append(f"--port must be in 1..65535, got {args.port}")
    if not (math.isfinite(args.kv_wait_timeout) and args.kv_wait_timeout > 0):
        errors.append(f"--kv-wait-timeout must be a positive number of seconds, got {args.kv_wait_timeout:g}")
    if error := max_model_len_error(args.max_model_len):
        errors.append(error)
    return errors + _profile_errors(args)


def _profile_errors(args: argparse.Namespace) -> list[str]:
    if args.profile is None:
        return []
    from conductor.core.profile_table import load_profile

    try:
        load_profile(args.profile)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"--profile {args.profile}: cannot be read as a profile table ({exc})"]
    return []


def _auth_errors(args: argparse.Namespace) -> list[str]:
    """A cluster token or API keys file that cannot be used, refused before anything starts."""
    from conductor.auth import load_api_keys
    from mooncake.auth import token_errors

    try:
        load_api_keys(args.api_keys_file, args.api_key)
    except ValueError as exc:
        return [str(exc), *token_errors(args)]
    return token_errors(args)


def _cmd_conductor(args: argparse.Namespace) -> int:
    from conductor.app import close_streams, create_app, drain_conductor
    from conductor.config import ConductorConfig
    from mooncake.drain import DrainingServer
    from mooncake.net import http_server_config

    from conductor.auth import load_api_keys
    from conductor.cli_args import scheduler_config, slo_bounds
    from mooncake.auth import token_from_args
    from mooncake.engine.cli import registry_url
    from mooncake.registry.config import EtcdCredentials

    if _missing_model("conductor", args.model):
        return 2
    model = _resolve_model(args.model)
    if _unfit_model("conductor", model, args, kv_cache=False):
        return 2
    config = ConductorConfig(
        model_path=model, served_model_name=args.served_model_name or Path(model).name, host=args.host,
        port=args.port, prefill_urls=tuple(args.prefill_url), decode_urls=tuple(args.decode_url),
        max_model_len=args.max_model_len, api_keys=load_api_keys(args.api_keys_file, args.api_key),
        cluster_token=token_from_args(args), etcd_credentials=EtcdCredentials.from_env(),
        kv_wait_timeout_s=args.kv_wait_timeout,
        registry_url=registry_url(args), registry_ttl_s=args.registry_ttl, scheduler=scheduler_config(args),
        profile=args.profile, dtype=Dtype(args.dtype), slo_bounds=slo_bounds(args),
        drain_timeout_s=args.drain_timeout,
    )
    app = create_app(config)
    DrainingServer(http_server_config(app, args.host, args.port, log_level="info", log_config=uvicorn_log_config()),
                   drain=lambda: drain_conductor(app), on_exit=lambda: close_streams(app)).run()
    return 0


def _cmd_worker(module):
    def run(args: argparse.Namespace) -> int:
        command = args.subparser.prog.split()[-1]
        if _missing_model(command, args.model):
            return 2
        model = _resolve_model(args.model)
        if _unfit_model(command, model, args):
            return 2
        return module.run(args, model, _start_pool)
    return run


def _pool_config(config):
    """The worker's PoolConfig from its WorkerConfig."""
    from store.config import PoolConfig

    return PoolConfig(dram_bytes=config.pool_dram_bytes, ssd_dir=config.pool_ssd_dir,
                      ssd_bytes=config.pool_ssd_bytes, policy=config.pool_policy,
                      map_same_host_peers=config.pool_map_peers, ssd_shared_by=config.pool_ssd_shared_by)


def _start_pool(config):
    """The worker's KVCache pool service (store/), started in its shell before the engine."""
    from dataclasses import replace

    from messenger.engine import EngineConfig
    from messenger.rdma_plan import RdmaConfig
    from mooncake.auth import kv_key
    from store.service import PoolService

    pool = _pool_config(config)
    # Other nodes fetch blocks from this pool through the messenger (Algorithm 1's fetch_from),
    # proving the key derived from the cluster token, like the KV socket; each block carries its
    # own checksum, so the messenger's per-slice one is off.
    transports = defaults.kv_transports()
    messenger = replace(EngineConfig(), host=config.kv_host, advertise_host=config.advertise_host, checksums=False,
                        transports=transports, rdma=RdmaConfig.from_env() if "rdma" in transports else None,
                        auth_key=kv_key(config.cluster_token) if config.cluster_token else None)
    return PoolService(pool, remote=True, engine_config=messenger).start()


def _cmd_prepare(args: argparse.Namespace) -> int:
    print(_resolve_model(None))
    return 0


def _add_auth_arguments(parser: argparse.ArgumentParser, generated_token: bool) -> None:
    from mooncake.auth import add_token_arguments

    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 (one key, "
                                                         "every model; see also --api-keys-file)")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="API keys of /v1, one per line, each optionally followed by the comma-separated "
                             "models it may use; MOONCAKE_API_KEYS adds comma-separated keys for every model. "
                             "No key at all: the API is open")
    add_token_arguments(parser, generated=generated_token)


def build_parser() -> argparse.ArgumentParser:
    from conductor.cli_args import add_scheduler_arguments
    from decode import main as decode_main
    from mooncake.engine.cli import add_pool_arguments
    from prefill import main as prefill_main

    parser = argparse.ArgumentParser(prog="mooncake", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the embedded cluster (conductor + prefill + decode)",
                           formatter_class=DefaultsHelpFormatter,
                           description="Start N prefill and M decode workers on this machine and the "
                                       "OpenAI-compatible conductor in front of them. Ctrl-C stops all. With "
                                       "--pool-ssd-dir each worker keeps its pool's SSD tier in its own "
                                       "subdirectory of it (prefill-0, decode-1, ...), all on one disk: each starts "
                                       "at no more than 1/(N+M) of the disk's free space less a tenth, besides its "
                                       "own files there (a worker's --pool-ssd-shared-by).")
    serve.add_argument("--model", default=None, help="safetensors model folder (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", default=None, help="model name clients use")
    serve.add_argument("--host", default="127.0.0.1", help="conductor bind address")
    serve.add_argument("--port", type=int, default=defaults.CONDUCTOR_PORT, help="conductor port (the public API)")
    serve.add_argument("--prefill", type=int, default=1, help="prefill workers to start")
    serve.add_argument("--decode", type=int, default=1, help="decode workers to start")
    serve.add_argument("--worker-port", type=int, default=defaults.PREFILL_PORT,
                       help="first internal port of the workers")
    serve.add_argument("--dtype", default=str(defaults.DTYPE), choices=[str(d) for d in Dtype],
                       help="float32 keeps greedy output exact on CPU; bfloat16 is faster")
    serve.add_argument("--max-model-len", type=int, default=defaults.MAX_MODEL_LEN,
                       help="longest prompt+output (tokens)")
    serve.add_argument("--kv-cache-gib", type=float, default=defaults.KV_CACHE_GIB,
                       help="KV cache per worker on CPU, GiB (on a GPU vLLM sizes it by its memory utilization)")
    serve.add_argument("--chunk-size", type=int, default=defaults.CHUNK_SIZE,
                       help="the prefill workers' prefill chunk (tokens per engine step); with --prefill 0 "
                            "the decode workers' too")
    serve.add_argument("--decode-chunk-size", type=int, default=defaults.DECODE_CHUNK_SIZE,
                       help="the decode workers' tokens per engine step (default: the prefill chunk): the gap a "
                            "prompt they take (flexible roles, conditional disaggregation) puts between their "
                            "running requests' tokens. A step that fits the TBT SLO (e.g. 128 on one CPU core) "
                            "lets them prefill while they decode")
    serve.add_argument("--max-worker-restarts", type=int, default=defaults.WORKER_MAX_RESTARTS, metavar="N",
                       help=f"a worker that dies once the cluster is up is restarted (after a back-off), at most N "
                            f"times within {defaults.WORKER_RESTART_WINDOW_S:g} s; 0: never")
    _add_auth_arguments(serve, generated_token=True)
    add_pool_arguments(serve)
    add_scheduler_arguments(serve)
    serve.set_defaults(func=_cmd_serve, check=_check_serve, subparser=serve)

    for name, module, text in (("prefill", prefill_main, "run one prefill worker"),
                               ("decode", decode_main, "run one decode worker")):
        p = sub.add_parser(name, help=text, description=module.__doc__, formatter_class=DefaultsHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=_cmd_worker(module), check=module.check, subparser=p)

    cond = sub.add_parser("conductor", help="run the API server alone, pointed at workers",
                          formatter_class=DefaultsHelpFormatter,
                          description="The OpenAI-compatible conductor for workers started elsewhere.")
    cond.add_argument("--model", default=None, help="model folder (for the tokenizer and chat template)")
    cond.add_argument("--served-model-name", default=None, help="model name clients use")
    cond.add_argument("--host", default="127.0.0.1", help="bind address")
    cond.add_argument("--port", type=int, default=defaults.CONDUCTOR_PORT, help="public port")
    cond.add_argument("--prefill-url", action="append", default=[], help="a prefill worker's URL (repeat)")
    cond.add_argument("--decode-url", action="append", default=[], help="a decode worker's URL (repeat)")
    cond.add_argument("--max-model-len", type=int, default=defaults.MAX_MODEL_LEN,
                      help="longest prompt+output (tokens)")
    _add_auth_arguments(cond, generated_token=False)
    cond.add_argument("--kv-wait-timeout", type=float, default=defaults.KV_WAIT_TIMEOUT_S,
                      help="seconds a decode worker waits for pushed KV before recomputing")
    cond.add_argument("--etcd", default=None,
                      help="follow an etcd cluster's registry (http://HOST:PORT or etcd://HOST:PORT); "
                           "default: host the embedded registry (workers use --registry embedded+http://...)")
    cond.add_argument("--registry", default=None, help="registry URL (etcd://HOST:PORT); same as --etcd")
    cond.add_argument("--registry-ttl", type=float, default=defaults.REGISTRY_TTL_S,
                      help="seconds before a silent worker leaves routing")
    cond.add_argument("--dtype", default=str(defaults.DTYPE), choices=[str(d) for d in Dtype],
                      help="the workers' dtype: picks the bundled profile table measured in it")
    cond.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S,
                      help="on SIGTERM, /health turns 503 and the conductor waits this long at most for "
                           "the requests in flight")
    add_scheduler_arguments(cond)
    cond.set_defaults(func=_cmd_conductor, check=_check_conductor, subparser=cond)

    prep = sub.add_parser("prepare-model", help="convert the default model once; prints its folder")
    prep.set_defaults(func=_cmd_prepare)
    for name, target, text in (("sim", "conductor.sim.cli", "simulate the scheduler on a trace"),
                               ("profile", "conductor.profile.cli", "profile the engine for the scheduler"),
                               ("bench", "mooncake.bench.cli", "load-test an OpenAI-compatible endpoint")):
        p = sub.add_parser(name, help=text, add_help=False)
        p.set_defaults(forward=target)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    forwarded = {"sim": "conductor.sim.cli", "profile": "conductor.profile.cli", "bench": "mooncake.bench.cli"}
    if argv and argv[0] in forwarded:
        # These have their own parsers (sim and profile owned by the scheduler package); forward the rest.
        import importlib

        target = forwarded[argv[0]]
        return importlib.import_module(target).main(argv[1:])
    args = build_parser().parse_args(argv)
    # Options no engine can take are refused here, before a model is prepared or a process
    # starts (usage message, exit code 2), rather than by every engine minutes later.
    errors = args.check(args) if hasattr(args, "check") else []
    if errors:
        args.subparser.error("; ".join(errors))
    from mooncake.model import ModelUnavailable

    try:
        return args.func(args)
    except ModelUnavailable as exc:
        prog = args.subparser.prog if hasattr(args, "subparser") else f"mooncake {args.command}"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
