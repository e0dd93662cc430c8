"""ConductorConfig: the public API server's settings, validated up front."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from conductor.auth import ApiKey
from conductor.core.config import SchedulerConfig
from conductor.core.estimators import Estimators
from conductor.core.profile_table import bundled_profile_exists, load_profile
from conductor.slo import SLOBounds
from mooncake import defaults
from mooncake.defaults import Dtype
from mooncake.registry.config import EtcdCredentials

log = logging.getLogger(__name__)

DEFAULT_PROFILE = defaults.PROFILE


def resolve_profile(profile: str | None, dtype: Dtype) -> str:
    """The profile table to price with: `profile` if given, else the bundled table measured in the
    workers' dtype; if none is bundled for that dtype, the float32 one, with a warning (its times
    are those of another dtype; the calibration corrects them as measurements come in)."""
    if profile is not None:
        return profile
    name = defaults.profile_name(DEFAULT_PROFILE, dtype)
    if bundled_profile_exists(name):
        return name
    log.warning("no bundled profile table %s for dtype %s; pricing with %s (measured in float32) until "
                "calibration learns this cluster's speed. Measure one: mooncake profile --dtype %s",
                name, dtype, DEFAULT_PROFILE, dtype)
    return DEFAULT_PROFILE


def live_estimators(profile: str) -> Estimators:
    """The live conductor's estimators: fitted from the profile table (a bundled name or a path),
    with a remote fetch's fixed cost as measured on a live cluster (defaults.FETCH_LATENCY_S)."""
    return Estimators.from_profile(load_profile(profile), transfer_latency_s=defaults.FETCH_LATENCY_S)


def live_scheduler_config(**overrides) -> SchedulerConfig:
    """The live cluster's scheduler config: SchedulerConfig's own defaults are paper-scale (the
    simulator's), so the live values of mooncake.defaults are always passed explicitly here."""
    knobs = dict(block_size=defaults.KV_BLOCK_SIZE, ttft_slo_s=defaults.TTFT_SLO_S, tbt_slo_s=defaults.TBT_SLO_S,
                 default_decode_s=defaults.DEFAULT_DECODE_S, flexible_roles=defaults.FLEXIBLE_ROLES,
                 role_cost_s=defaults.ROLE_COST_S, chunk_tokens=defaults.CHUNK_SIZE,
                 best_effort_when_idle=defaults.BEST_EFFORT_WHEN_IDLE,
                 # Priced only from holders whose pools serve other nodes (InstanceState.serves_fetches).
                 remote_fetch=defaults.REMOTE_FETCH, kvcache_balancing_threshold=defaults.BALANCING_THRESHOLD)
    return SchedulerConfig(**{**knobs, **overrides})


def worker_block_size_error(worker_block_size: int, conductor_block_size: int) -> str | None:
    """Why a worker registered with `worker_block_size` must not be routed to, or None.

    The conductor refuses such a worker rather than following the workers' block size: prompt
    hashes, the global prefix index, the scheduler's pricing (cached and fetched tokens) and the
    KV transfer plans all count in blocks, and a cluster whose workers disagree has no single
    block size to follow. One fixed size, given to the conductor and to every worker (serve does
    both from one value), keeps them all in one unit; a mismatch is a configuration error the
    user must see, not something to adapt to silently."""
    if worker_block_size and worker_block_size != conductor_block_size:
        return (f"its KV block size is {worker_block_size} tokens but the conductor's is {conductor_block_size}; "
                f"start the worker with --block-size {conductor_block_size} (or the conductor with "
                f"--block-size {worker_block_size})")
    return None


@dataclass(frozen=True)
class ConductorConfig:
    model_path: str
    """Safetensors folder; the conductor loads only its tokenizer and chat template."""
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = defaults.CONDUCTOR_PORT
    prefill_urls: tuple[str, ...] = ()
    """Internal URLs of prefill-capable workers (embedded cluster; a registry adds more)."""
    decode_urls: tuple[str, ...] = ()
    max_model_len: int = defaults.MAX_MODEL_LEN
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    """If any, every /v1 request must carry `Authorization: Bearer KEY` with one of them (else
    401), and a key limited to some models may use only those (else 403); conductor/auth.py."""
    cluster_token: str | None = field(default=None, repr=False)
    """Sent to the workers' internal API and asked of every /internal/* caller (the embedded
    registry's workers); None only in a cluster started with --insecure-no-cluster-token."""
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    """Larger request bodies are refused with 413 before they are parsed."""
    max_in_flight: int = 256
    """Requests in progress beyond this are refused with 429 and a Retry-After."""
    token_timeout_s: float = 120.0
    """A worker silent for this long mid-request is treated as dead (error, never a hung stream)."""
    kv_wait_timeout_s: float = defaults.KV_WAIT_TIMEOUT_S
    """How long a decode worker waits for pushed KV before recomputing the prompt itself."""
    health_interval_s: float = 1.0
    health_timeouts_tolerated: int = defaults.HEALTH_TIMEOUTS_TOLERATED
    """A ready worker whose /health times out this many polls in a row is still routed to; the next
    one takes it out of rotation. A busy engine can starve its server's event loop for a few
    seconds (vLLM's own /health is known to answer late under load), and taking it out would move
    its traffic, and its cached prefixes, elsewhere. A refused connection or an error answer takes
    it out at once. When timeouts take it out, its streams that went silent are given up (an
    error, or a retry elsewhere before the first token) rather than wait token_timeout_s."""
    registry_url: str | None = None
    """etcd://HOST:PORT to follow an etcd cluster; None hosts the embedded registry on this
    server (workers register with --registry embedded+http://THIS_HOST:PORT)."""
    registry_ttl_s: float = defaults.REGISTRY_TTL_S
    etcd_credentials: EtcdCredentials | None = None
    """The etcd user to log in as when etcd's authentication is on (MOONCAKE_ETCD_USER/PASSWORD)."""
    kv_events_interval_s: float = 0.25
    """How often newly ready workers get a follower of their KV events (a long poll each, which
    the worker answers the moment a block is stored or removed), and the least time between two
    polls of a worker that answered at once with nothing."""
    scheduler: SchedulerConfig = field(default_factory=live_scheduler_config)
    """The scheduling core's knobs (policy, admission, SLOs). block_size must equal the workers'
    (see worker_block_size_error)."""
    profile: str | None = None
    """Profile table the estimators are fitted from: a bundled name or a JSON path; None, the
    bundled one measured in `dtype` (resolve_profile)."""
    dtype: Dtype = defaults.DTYPE
    """The workers' dtype: chooses the bundled profile table."""
    slo_bounds: SLOBounds = field(default_factory=SLOBounds)
    """What a request may set itself: its priority and its TTFT and TBT SLOs (conductor/slo.py).
    The SLO classes it may name are the scheduler's (slo_classes) and `default`."""
    drain_timeout_s: float = defaults.DRAIN_TIMEOUT_S
    """On SIGTERM: /health says 503 draining, and the server waits this long at most for the
    requests in flight before it exits (mooncake/drain.py)."""

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.max_model_len < defaults.MIN_MODEL_LEN or self.max_body_bytes < 1024 or self.max_in_flight < 1:
            raise ValueError("max_model_len, max_body_bytes and max_in_flight are too small")
        if self.token_timeout_s <= 0 or self.kv_wait_timeout_s <= 0 or self.health_interval_s <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.health_timeouts_tolerated < 0:
            raise ValueError(f"health_timeouts_tolerated must be >= 0, got {self.health_timeouts_tolerated}")
