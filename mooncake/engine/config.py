"""WorkerConfig: everything one prefill or decode worker process needs, validated up front."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    """"prefill" pushes prompt KV to a decode worker; "decode" receives it; "both" does either."""
    model: str
    """Path of the safetensors model folder."""
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8100
    """Internal HTTP API (generate, abort, health, load, metrics)."""
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    """Where this worker receives pushed KV bytes; 0 picks a free port."""
    advertise_host: str | None = None
    """Host other processes use to reach this worker (defaults to `host`)."""
    dtype: str = "float32"
    """float32 keeps greedy output identical across prefix-cached, colocated and disaggregated
    runs on vLLM-CPU; bfloat16 is faster but its rounding depends on the compute path."""
    max_model_len: int = 8192
    kv_cache_gib: float = 1.0
    """KV cache size (VLLM_CPU_KVCACHE_SPACE on CPU)."""
    cpu_bind: str | None = None
    """CPU cores for the engine's OpenMP threads, e.g. "0" or "0-3" (VLLM_CPU_OMP_THREADS_BIND)."""
    max_num_batched_tokens: int = 2048
    """Tokens per engine step; longer prompts are prefilled in chunks of this size."""
    enable_prefix_caching: bool = True
    block_size: int = 128
    """KV block size (tokens): the unit of prefix caching, KV events and transfers."""
    enforce_eager: bool = True
    instance_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    registry_url: str | None = None
    """Where to register once the engine is ready: etcd://HOST:PORT, or
    embedded+http://CONDUCTOR:PORT for the conductor-hosted registry. None: do not register
    (the conductor then knows this worker only by a static --prefill-url/--decode-url)."""
    registry_ttl_s: float = 5.0
    """A worker that stops refreshing its registration disappears from routing after this."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 <= self.port < 65536 or not 0 <= self.kv_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.max_model_len < 16 or self.kv_cache_gib <= 0 or self.max_num_batched_tokens < 16:
            raise ValueError("max_model_len, kv_cache_gib and max_num_batched_tokens must be positive")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def http_url(self) -> str:
        return f"http://{self.public_host}:{self.port}"
