"""WorkerConfig: everything one prefill or decode worker process needs, validated up front."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from mooncake import defaults
from mooncake.defaults import Dtype, WorkerRole, engine_option_errors
from mooncake.net import url_host
from mooncake.registry.config import EtcdCredentials


@dataclass(frozen=True)
class WorkerConfig:
    role: WorkerRole
    """PREFILL pushes prompt KV to a decode worker; DECODE receives it; BOTH does either."""
    model: str
    """Path of the safetensors model folder."""
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = defaults.PREFILL_PORT
    """Internal HTTP API (generate, abort, health, load, metrics)."""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    """Where this worker receives pushed KV bytes; 0 picks a free port."""
    advertise_host: str | None = None
    """Host other processes use to reach this worker (defaults to `host`)."""
    dtype: Dtype = defaults.DTYPE
    """See Dtype: float32 keeps greedy output exact on CPU."""
    max_model_len: int = defaults.MAX_MODEL_LEN
    kv_cache_gib: float = defaults.KV_CACHE_GIB
    """KV cache size on CPU, GiB (on a GPU vLLM sizes it by its memory utilization)."""
    cpu_bind: str | None = None
    """CPU cores for the engine's OpenMP threads, e.g. "0" or "0-3" (VLLM_CPU_OMP_THREADS_BIND)."""
    max_num_batched_tokens: int = defaults.CHUNK_SIZE
    """Tokens per engine step; longer prompts are prefilled in chunks of this size."""
    enable_prefix_caching: bool = True
    block_size: int = defaults.KV_BLOCK_SIZE
    """KV block size (tokens): the unit of prefix caching, KV events and transfers."""
    enforce_eager: bool = True
    instance_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    registry_url: str | None = None
    """Where to register once the engine is ready: etcd://HOST:PORT, or
    embedded+http://CONDUCTOR:PORT for the conductor-hosted registry. None: do not register
    (the conductor then knows this worker only by a static --prefill-url/--decode-url)."""
    registry_ttl_s: float = defaults.REGISTRY_TTL_S
    """A worker that stops refreshing its registration disappears from routing after this."""
    cluster_token: str | None = field(default=None, repr=False)
    """Asked of every /internal/* caller, sent to the embedded registry, and the root of the KV
    socket's handshake key (mooncake/auth.py). None only with --insecure-no-cluster-token."""
    etcd_credentials: EtcdCredentials | None = None
    """The etcd user to log in as when etcd's authentication is on (MOONCAKE_ETCD_USER/PASSWORD)."""
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S
    """On SIGTERM: how long to wait for the requests in flight after leaving routing."""
    pool_dram_bytes: int = defaults.POOL_DRAM_BYTES
    """DRAM tier of this node's KVCache pool (store/); 0: no pool at all (--no-pool)."""
    pool_ssd_dir: str | None = defaults.POOL_SSD_DIR
    """SSD tier's directory; None: DRAM only."""
    pool_ssd_bytes: int = defaults.POOL_SSD_BYTES
    pool_policy: str = defaults.POOL_POLICY
    """Eviction policy of both tiers."""
    pool_map_peers: bool = True
    """Copy a same-host pool's blocks out of its arena (store/peer_arena.py); False: over the messenger."""
    pool_ssd_shared_by: int = 1
    """Pools whose SSD tiers start on pool_ssd_dir's disk together (store.config.PoolConfig.ssd_shared_by)."""

    def __post_init__(self) -> None:
        if self.role not in tuple(WorkerRole):
            raise ValueError(f"role must be one of {[str(r) for r in WorkerRole]}, got {self.role!r}")
        if self.dtype not in tuple(Dtype):
            raise ValueError(f"dtype must be one of {[str(d) for d in Dtype]}, got {self.dtype!r}")
        object.__setattr__(self, "role", WorkerRole(self.role))
        object.__setattr__(self, "dtype", Dtype(self.dtype))
        if not 0 <= self.port < 65536 or not 0 <= self.kv_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.pool_dram_bytes < 0 or self.pool_ssd_bytes < 0:
            raise ValueError("pool sizes must be >= 0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_model_len < defaults.MIN_MODEL_LEN:
            raise ValueError(f"max_model_len must be >= {defaults.MIN_MODEL_LEN}, got {self.max_model_len}")
        errors = engine_option_errors(self.kv_cache_gib, self.block_size, self.max_num_batched_tokens)
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def http_url(self) -> str:
        return f"http://{url_host(self.public_host)}:{self.port}"


def cpu_bind_error(spec: str, allowed: set[int] | None = None) -> str | None:
    """--cpu-bind as vLLM reads it ("0-3,8"): core ids and ranges; with `allowed` (the cores the
    worker's process may use, known only where it runs), among those."""
    try:
        cores = set()
        for part in spec.split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        return f"--cpu-bind takes core ids and ranges such as 0-3,8, got {spec!r}"
    if not cores:
        return f"--cpu-bind {spec}: names no core"
    if allowed is not None and not cores <= allowed:
        return (f"--cpu-bind {spec}: cores {sorted(cores - allowed)} are not among those this process may use "
                f"({sorted(allowed)})")
    return None
