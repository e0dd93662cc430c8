"""The scheduler core's one config dataclass."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from mooncake.defaults import DEFAULT_SLO_CLASS, PRIORITY_HEADROOM


# Paper-scale values (Mooncake's 512-token blocks and a 0.1 s TBT SLO for a 70B model on
# GPUs): the defaults of this core and of the simulator, which replays paper-scale traces.
# The live cluster's values are different on purpose (a 135M model on CPU) and are set, in
# one place, in mooncake.defaults; the live conductor always passes them explicitly.
PAPER_BLOCK_SIZE = 512
PAPER_TTFT_SLO_S = 30.0
PAPER_TBT_SLO_S = 0.1
PAPER_DEFAULT_DECODE_S = 20.0


@dataclass(frozen=True, slots=True)
class SLOClass:
    """An operator's class of requests: its SLOs and its priority (lower is more important, as
    vLLM's `priority`). Requests of a less important priority keep headroom free for it (see
    SchedulerConfig.priority_headroom)."""

    name: str
    ttft_slo_s: float
    tbt_slo_s: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an SLO class needs a name")
        for name in ("ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"SLO class {self.name!r}: {name} must be a positive finite number of seconds, "
                                 f"got {v}")


class Policy(enum.StrEnum):
    RANDOM = "random"
    LOAD_BALANCE = "load-balance"
    CACHE_AWARE = "cache-aware"
    KVCACHE_CENTRIC = "kvcache-centric"


class Admission(enum.StrEnum):
    NONE = "none"  # never refuse; SLOs are only measured
    BASELINE = "baseline"  # TTFT gate before prefill; the decode side refuses after prefill
    EARLY = "early"  # also judge the decode instances' current load before prefill (6.2)
    PREDICTION = "prediction"  # judge the decode load forecast for when prefill ends (6.4)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of the KVCache-centric scheduler (paper sections 4-6). Defaults are paper-scale
    (PAPER_*); the live conductor builds its config with conductor.config.live_scheduler_config."""

    policy: Policy = Policy.KVCACHE_CENTRIC
    """Prefill/decode selection policy."""
    admission: Admission = Admission.PREDICTION
    """Overload admission policy."""
    block_size: int = PAPER_BLOCK_SIZE
    """Tokens per prefix block, the unit of the prefix index and of KV transfers."""
    ttft_slo_s: float = PAPER_TTFT_SLO_S
    """A request whose predicted time to first token exceeds this is refused."""
    tbt_slo_s: float = PAPER_TBT_SLO_S
    """A decode instance whose predicted time between tokens would exceed this takes no more."""
    kvcache_balancing_threshold: float = 1.5
    """Algorithm 1: fetch the best holder's longer prefix when best_len / local_len reaches
    this ratio; below it, recompute locally (a short extra prefix is not worth a transfer)."""
    remote_fetch: bool = True
    """Whether an instance can pull another's prefix blocks (Algorithm 1's fetch_from). The
    simulator models it; the live cluster carries it out through the workers' KVCache pools
    (store/) and offers only holders whose pools serve other nodes (InstanceState.serves_fetches):
    pricing a fetch that never happens routes prompts away from the instance that caches them.
    Off, an instance is priced by what it holds itself."""
    conditional_disaggregation: bool = True
    """Let kvcache-centric prefill a short prompt on its decode instance (section 4)."""
    colocate_max_new_tokens: int = 2048
    """Largest uncached part that may be prefilled in one step on a decode instance."""
    flexible_roles: bool = False
    """Let any instance prefill and any instance decode a request, P = D included, whatever its
    label (kvcache-centric only). Labels then only add role_cost_s. Off by default: the paper's
    fixed roles, which the simulator models; the live cluster turns it on (mooncake.defaults)."""
    role_cost_s: float = 0.3
    """With flexible_roles: seconds added to a candidate's predicted TTFT, when ranking, per role
    it plays against its label (a prefill-labelled instance decoding; a decode-labelled one
    prefilling beyond conditional disaggregation's one-step budget). Never used for admission."""
    chunk_tokens: int = 2048
    """The engine's token budget per step (vLLM's max_num_batched_tokens, the workers'
    --chunk-size) for an instance that does not say its own (InstanceState.chunk_tokens): with
    flexible_roles, a prompt prefilled on an instance with a running batch runs in steps of this
    many tokens, each one also stepping the batch."""
    default_decode_s: float = PAPER_DEFAULT_DECODE_S
    """Uniform decode duration t_d assumed by prediction until the cluster has measured one."""
    decode_forecast: str = "fluid"
    """How prediction forecasts running sequences at t*: "fluid" (Little's law thinning) or
    "age" (gone t_d after they started, the paper's wording); see admission.decode_load."""
    gate_kv_headroom: float = 0.0
    """Fraction of each decode instance's KV capacity that the early and prediction gates keep
    free as a margin for forecast error (the decode side's own check uses all of it)."""
    decode_hold_s: float = 0.0
    """How long a decode instance may hold an arriving prefilled request whose KV does not fit
    yet (its KV waits in the node's DRAM), re-checking at each step boundary, before refusing
    it. 0 = refuse at once (the paper's behaviour). The wait shows up in that request's TBT
    (between its first and second token). Implemented by the shell (the simulator; the live
    decode worker still refuses at once)."""
    slo_classes: tuple[SLOClass, ...] = ()
    """The operator's SLO classes besides the default one (ttft_slo_s and tbt_slo_s at priority
    0). A request is admitted only within (1 - priority_headroom) of the SLOs of every class
    more important than it (a lower priority number): admission.limits_for."""
    priority_headroom: float = PRIORITY_HEADROOM
    """Share of a more important class's TTFT and TBT SLOs, and of each decode instance's KV
    capacity, that a less important request leaves free (admission.limits_for)."""
    best_effort_when_idle: bool = False
    """A request that misses its TTFT SLO even on an idle cluster (its own prefill alone takes
    longer) is admitted, best effort, when no instance that may prefill has anything queued, and
    refused otherwise, with a Retry-After of the longest queue's drain: under load it would take
    time from requests that can still meet theirs. Off: refused whatever the load (the paper's
    rule, and the simulator's default), so such a request is never served. A request that set its
    own TTFT SLO tighter than ttft_slo_s is always refused: it said a late answer is no use. The
    live conductor turns it on (mooncake.defaults.BEST_EFFORT_WHEN_IDLE)."""
    min_retry_after_s: float = 1.0
    """Floor of Retry-After (clients should not hammer)."""
    max_retry_after_s: float = 300.0
    """Ceiling of Retry-After, also given when waiting cannot help (a prompt too long for its SLO,
    best_effort_when_idle off)."""
    space_retries: bool = True
    """The shell spaces the Retry-After of requests refused together by their share of the
    resource they wait for (retry_book.py), so they do not all come back at once. Off: each is told
    its own drain, as if it were the only one refused."""
    seed: int = 0
    """Seed of the random policy's generator, for reproducible runs."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        object.__setattr__(self, "admission", Admission(self.admission))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("ttft_slo_s", "tbt_slo_s", "default_decode_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive finite number of seconds, got {v}")
        if not self.kvcache_balancing_threshold >= 1.0:
            raise ValueError(
                "kvcache_balancing_threshold is a ratio best_prefix/local_prefix and must be >= 1 "
                f"(1 = always fetch a longer prefix), got {self.kvcache_balancing_threshold}")
        if self.decode_forecast not in ("fluid", "age"):
            raise ValueError(f"decode_forecast must be 'fluid' or 'age', got {self.decode_forecast!r}")
        if not 0.0 <= self.gate_kv_headroom < 1.0:
            raise ValueError(f"gate_kv_headroom must be in [0, 1), got {self.gate_kv_headroom}")
        if not (self.decode_hold_s >= 0 and math.isfinite(self.decode_hold_s)):
            raise ValueError(f"decode_hold_s must be a finite number of seconds >= 0, got {self.decode_hold_s}")
        if self.flexible_roles and self.policy is not Policy.KVCACHE_CENTRIC:
            raise ValueError(f"flexible_roles needs the kvcache-centric policy (it prices every instance in both "
                             f"roles by predicted TTFT), got {self.policy}")
        if not (self.role_cost_s >= 0 and math.isfinite(self.role_cost_s)):
            raise ValueError(f"role_cost_s must be a finite number of seconds >= 0, got {self.role_cost_s}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if self.colocate_max_new_tokens < 0:
            raise ValueError("colocate_max_new_tokens must be >= 0")
        if not 0.0 <= self.priority_headroom < 1.0:
            raise ValueError(f"priority_headroom must be in [0, 1), got {self.priority_headroom}")
        names = [c.name for c in self.slo_classes]
        if len(set(names)) != len(names) or DEFAULT_SLO_CLASS in names:
            raise ValueError(f"SLO class names must be unique and not {DEFAULT_SLO_CLASS!r} (the class of "
                             f"ttft_slo_s and tbt_slo_s), got {names}")
        if not 0 <= self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 <= min_retry_after_s <= max_retry_after_s")
