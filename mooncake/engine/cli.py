"""Command-line options of a worker (`mooncake prefill` / `mooncake decode`)."""

from __future__ import annotations

import argparse
import math
import os

from mooncake import defaults
from mooncake.auth import add_token_arguments, token_errors, token_from_args
from mooncake.defaults import Dtype, WorkerRole, engine_option_errors, max_model_len_error
from mooncake.engine.config import WorkerConfig, cpu_bind_error
from mooncake.paths import unusable_directory
from mooncake.registry.config import EtcdCredentials


def add_worker_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--model", default=None,
                        help="safetensors model folder (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of the internal HTTP API")
    parser.add_argument("--port", type=int, default=default_port, help="port of the internal HTTP API")
    parser.add_argument("--kv-port", type=int, default=0,
                        help="port where this worker receives KV bytes (0: any free port)")
    parser.add_argument("--advertise-host", default=None,
                        help="address other hosts use to reach this worker (default: --host; needed with "
                             "--host 0.0.0.0 in a multi-host cluster)")
    parser.add_argument("--dtype", choices=[str(d) for d in Dtype], default=str(defaults.DTYPE),
                        help="weights and KV dtype; float32 keeps greedy output exact on CPU")
    parser.add_argument("--max-model-len", type=int, default=defaults.MAX_MODEL_LEN,
                        help="longest prompt+output (tokens)")
    parser.add_argument("--kv-cache-gib", type=float, default=defaults.KV_CACHE_GIB,
                        help="KV cache size on CPU, GiB (ignored on a GPU, where vLLM sizes the KV cache itself: "
                             "the share of GPU memory it takes, less the weights)")
    parser.add_argument("--cpu-bind", default=None,
                        help='cores for the engine threads, e.g. "0" or "0-3" (VLLM_CPU_OMP_THREADS_BIND)')
    parser.add_argument("--chunk-size", type=int, default=defaults.CHUNK_SIZE,
                        help="tokens per engine step; longer prompts prefill in chunks (tokens). On a decode "
                             "worker each step is a gap between its running requests' tokens when it takes a "
                             "prompt (128 on one CPU core fits a tight TBT SLO)")
    parser.add_argument("--block-size", type=int, default=defaults.KV_BLOCK_SIZE,
                        help=f"KV block size in tokens (a multiple of {defaults.BLOCK_SIZE_MULTIPLE} on CPU); "
                             "the conductor's must match")
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable the local prefix cache")
    parser.add_argument("--instance-id", default=None, help="stable name of this instance (default: random)")
    parser.add_argument("--registry", default=None,
                        help="register here when ready: etcd://HOST:PORT or embedded+http://CONDUCTOR:PORT")
    parser.add_argument("--etcd", default=None, help="shorthand for --registry etcd://HOST:PORT (accepts http://)")
    parser.add_argument("--registry-ttl", type=float, default=defaults.REGISTRY_TTL_S,
                        help="seconds after which a silent worker leaves routing")
    add_token_arguments(parser)
    parser.add_argument("--drain-timeout", type=float, default=defaults.DRAIN_TIMEOUT_S,
                        help="on SIGTERM, leave routing and wait this long at most for requests in flight")
    add_pool_arguments(parser)
    # A worker's alone: `serve` sets it (its workers keep their SSD tiers in subdirectories of one
    # --pool-ssd-dir), as may a deployment running several workers on one disk.
    parser.add_argument("--pool-ssd-shared-by", type=int, default=1, metavar="N",
                        help="KVCache pools (workers) whose SSD tiers start together on this --pool-ssd-dir's "
                             "disk: at start each takes at most 1/N of the disk's free space (less a tenth, "
                             "left to others) besides its own files found there, so together they never claim "
                             "it N times over; a disk that fills later still shrinks the tiers (serve passes "
                             "its worker count)")


POOL_DRAM_ENV = "MOONCAKE_POOL_DRAM_GIB"


def add_pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The node's KVCache pool (on by default); `mooncake serve` passes them to every worker."""
    parser.add_argument("--pool-dram-gib", type=float, default=_pool_dram_default(),
                        help=f"DRAM tier of the KVCache pool (GiB of shared memory, taken as blocks fill it; "
                             f"env {POOL_DRAM_ENV} sets the default, else {defaults.POOL_DRAM_BYTES / 2**30:g}; "
                             f"0 runs no pool, as --no-pool)")
    parser.add_argument("--pool-ssd-dir", default=defaults.POOL_SSD_DIR,
                        help="directory of the pool's SSD tier (kept across restarts; default: DRAM only)")
    parser.add_argument("--pool-ssd-gib", type=float, default=None,
                        help=f"most GiB of blocks the SSD tier keeps (with --pool-ssd-dir; default "
                             f"{defaults.POOL_SSD_BYTES / 2**30:g})")
    parser.add_argument("--pool-policy", default=defaults.POOL_POLICY, choices=defaults.POOL_POLICIES,
                        help="eviction policy of both tiers")
    parser.add_argument("--pool-map-peers", action=argparse.BooleanOptionalAction, default=True,
                        help="copy the blocks of a pool on this same host straight out of its shared-memory "
                             "arena (--no-pool-map-peers: over the messenger, as from another host)")
    parser.add_argument("--no-pool", action="store_true", help="run without the KVCache pool")


def _pool_dram_default() -> float:
    """The environment's default for --pool-dram-gib; one that is not a number is reported by the
    option check (as NaN), never a traceback while --help is built."""
    raw = os.environ.get(POOL_DRAM_ENV)
    if raw is None:
        return defaults.POOL_DRAM_BYTES / 2**30
    try:
        return float(raw)
    except ValueError:
        return math.nan


def pool_ssd_gib(args: argparse.Namespace) -> float:
    """--pool-ssd-gib, or its default (None when not given: so that a size without a directory
    can be told and refused)."""
    return defaults.POOL_SSD_BYTES / 2**30 if args.pool_ssd_gib is None else args.pool_ssd_gib


def pool_errors(args: argparse.Namespace) -> list[str]:
    if args.no_pool:  # nothing of the pool runs: its options would be ignored without a word
        return [f"--no-pool runs no KVCache pool: drop --pool-ssd-dir {args.pool_ssd_dir}"] if args.pool_ssd_dir else []
    errors = []
    if args.pool_ssd_gib is not None and not args.pool_ssd_dir:
        errors.append(f"--pool-ssd-gib {args.pool_ssd_gib:g} sizes an SSD tier, which runs only with --pool-ssd-dir "
                      f"(its directory); without one the pool keeps blocks in DRAM only")
    if args.pool_ssd_dir and args.pool_ssd_gib == 0:
        errors.append(f"--pool-ssd-dir {args.pool_ssd_dir} with --pool-ssd-gib 0: an SSD tier of 0 holds nothing; "
                      f"give it a size, or drop --pool-ssd-dir for a pool in DRAM only")
    if args.pool_ssd_dir and args.pool_dram_gib == 0:
        errors.append(f"--pool-ssd-dir {args.pool_ssd_dir} with --pool-dram-gib 0: a DRAM tier of 0 runs no pool, "
                      f"so no SSD tier either (blocks reach the SSD through DRAM)")
    if not all(math.isfinite(gib) and gib >= 0 for gib in (args.pool_dram_gib, pool_ssd_gib(args))):
        errors.append(f"--pool-dram-gib and --pool-ssd-gib must be finite and >= 0 (GiB), got "
                      f"{args.pool_dram_gib:g} and {pool_ssd_gib(args):g} (env {POOL_DRAM_ENV}: "
                      f"{os.environ.get(POOL_DRAM_ENV, 'unset')})")
    directory = args.pool_ssd_dir
    if directory:
        problem = unusable_directory(directory)
        if problem:
            errors.append(f"--pool-ssd-dir {directory}: {problem}")
    return errors


def check_worker_args(args: argparse.Namespace) -> list[str]:
    """Options the engine cannot take, found before the model is resolved or vLLM imported."""
    errors = engine_option_errors(args.kv_cache_gib, args.block_size, args.chunk_size)
    if error := max_model_len_error(args.max_model_len):
        errors.append(error)
    if not 0 <= args.drain_timeout < float("inf"):
        errors.append(f"--drain-timeout must be >= 0 seconds and finite, got {args.drain_timeout:g}")
    # The HTTP port is registered as given: 0 would publish an address nobody can reach.
    if not 1 <= args.port <= 65535 or not 0 <= args.kv_port <= 65535:
        errors.append(f"--port must be in 1..65535 and --kv-port in 0..65535 (0: any free one), got {args.port} "
                      f"and {args.kv_port}")
    if args.cpu_bind is not None and (error := cpu_bind_error(args.cpu_bind)):
        errors.append(error)
    for flag, host in (("--host", args.host), ("--advertise-host", args.advertise_host)):
        if host and ":" in host:  # (free_port and the messenger's listeners are AF_INET)
            errors.append(f"{flag} {host}: workers listen on and publish IPv4 addresses only; give an IPv4 address "
                          f"or a host name (--host 0.0.0.0: every interface)")
    if args.instance_id is not None and (not args.instance_id or "/" in args.instance_id):
        errors.append(f"--instance-id must be non-empty without '/', got {args.instance_id!r}")
    return errors + pool_errors(args) + ssd_share_errors(args) + token_errors(args) + registry_errors(args)


def ssd_share_errors(args: argparse.Namespace) -> list[str]:
    shared_by = args.pool_ssd_shared_by
    if shared_by < 1:
        return [f"--pool-ssd-shared-by counts the pools sharing the SSD tier's disk: >= 1, got {shared_by}"]
    if shared_by > 1 and not args.pool_ssd_dir:  # it would be ignored without a word
        return [f"--pool-ssd-shared-by {shared_by} shares out an SSD tier's disk, which runs only with "
                f"--pool-ssd-dir"]
    return []


def worker_config(args: argparse.Namespace, role: WorkerRole, model_path: str) -> WorkerConfig:
    from pathlib import Path

    extra = {"instance_id": args.instance_id} if args.instance_id else {}
    return WorkerConfig(
        role=role, model=model_path, served_model_name=args.served_model_name or Path(model_path).name,
        host=args.host, port=args.port, kv_host=args.host,
        kv_port=args.kv_port, advertise_host=args.advertise_host, dtype=args.dtype,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, cpu_bind=args.cpu_bind,
        max_num_batched_tokens=args.chunk_size, enable_prefix_caching=not args.no_prefix_caching,
        block_size=args.block_size, registry_url=registry_url(args), registry_ttl_s=args.registry_ttl,
        cluster_token=token_from_args(args), etcd_credentials=EtcdCredentials.from_env(),
        drain_timeout_s=args.drain_timeout, pool_ssd_shared_by=args.pool_ssd_shared_by, **pool_settings(args),
        **extra,
    )


def pool_settings(args: argparse.Namespace) -> dict:
    """WorkerConfig's pool fields from the options (--no-pool: a DRAM tier of 0, no pool)."""
    return dict(pool_dram_bytes=0 if args.no_pool else int(args.pool_dram_gib * 2**30),
                pool_ssd_dir=args.pool_ssd_dir, pool_ssd_bytes=int(pool_ssd_gib(args) * 2**30),
                pool_policy=args.pool_policy, pool_map_peers=args.pool_map_peers)


def pool_arguments(args: argparse.Namespace) -> tuple[str, ...]:
    """The pool options as a worker's command line (`mooncake serve` hands them to each worker;
    the launcher gives each its own SSD subdirectory)."""
    if args.no_pool:
        return ("--no-pool",)
    out = ("--pool-dram-gib", repr(float(args.pool_dram_gib)), "--pool-policy", args.pool_policy,
           "--pool-map-peers" if args.pool_map_peers else "--no-pool-map-peers")
    ssd = ("--pool-ssd-dir", args.pool_ssd_dir, "--pool-ssd-gib", repr(float(pool_ssd_gib(args))))
    return out + (ssd if args.pool_ssd_dir else ())


def registry_errors(args: argparse.Namespace) -> list[str]:
    """A registry this process could not use (a bad url, a TTL too short for its keepalives),
    refused before any engine loads: a worker would otherwise load, never register, and say
    nothing (its first registration runs in the background)."""
    from mooncake.registry.config import RegistryConfig

    etcd = getattr(args, "etcd", None) or ""
    given = getattr(args, "registry", None)
    if etcd and given:  # one would be ignored without a word
        return [f"give --etcd or --registry, not both (got {etcd} and {given})"]
    if (given or "").lower().startswith("memory://"):
        return [f"--registry {given}: memory:// is a registry inside one process, which no other process shares; "
                f"the conductor hosts the embedded one when given none (workers: --registry "
                f"embedded+http://CONDUCTOR:PORT), or give etcd://HOST:PORT"]
    if etcd.lower().startswith("https://"):
        # TLS to etcd is not wired (docs/SECURITY.md): stripping the scheme would speak plain
        # gRPC to a TLS port and retry for ever.
        return [f"--etcd {etcd}: TLS to etcd is not supported; give an http:// endpoint (or a TLS-terminating "
                f"proxy's)"]
    try:  # no url: the conductor's embedded registry (memory://), with the same TTL
        RegistryConfig(url=registry_url(args) or "memory://", ttl_s=args.registry_ttl)
    except ValueError as exc:
        return [f"--registry / --etcd / --registry-ttl: {exc}"]
    return []


def registry_url(args: argparse.Namespace) -> str | None:
    """--etcd http://H:P (the form etcd users type) means etcd://H:P."""
    if getattr(args, "etcd", None):
        host = args.etcd.split("://", 1)[-1].rstrip("/")
        return f"etcd://{host}"
    return getattr(args, "registry", None)
