"""Typed messages between the conductor and the workers' internal HTTP API.

The conductor is the only public API. Workers take token ids (the conductor tokenizes) and
answer with token ids (the conductor detokenizes), as newline-delimited JSON. Every message is
a msgspec Struct with one JSON encoder/decoder, so types and required fields are checked by
msgspec and its errors name the offending field path (e.g. `$.prompt_token_ids[2]`). Pydantic
stays at the public HTTP edge.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec


class Sampling(msgspec.Struct, frozen=True):
    """The subset of vLLM SamplingParams the conductor forwards."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id
    # Top logprobs per generated token (0: only the chosen token's); None: no logprobs at all.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token but the first
    # A structured-output constraint: (kind, spec) with kind "json" (spec: a JSON schema text,
    # "{}" for any JSON object), "regex", "choice" (spec: a JSON list) or "grammar" (EBNF).
    structured: tuple[str, str] | None = None

    def first_token_on_decode(self) -> bool:
        """Whether a disaggregated request's decode worker samples its first token too (the
        prefill worker's is dropped), because what it samples depends on every token it
        generated, which an engine knows only of the tokens it generated itself: a grammar's
        state; frequency and presence penalties, which count output tokens only (the prefill's
        token would be prompt to the decode engine); a seed, whose generator would start again
        at the second token."""
        return (self.structured is not None or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or (self.seed is not None and self.temperature > 0.0))

    def ends_at_prefill(self) -> bool:
        """Whether a disaggregated request's answer is the prefill worker's one token alone: no
        KV goes to the decode worker (conductor.relay), and its decode side is not priced."""
        return self.max_tokens == 1 and not self.first_token_on_decode()


# One position's logprobs, in vLLM's order: the chosen token first, then the top-k by rank
# (a top token equal to the chosen one is not repeated). Entries are (token id, logprob, rank),
# logprobs clamped to -9999.0 as vLLM's server does (JSON has no -inf).
PositionLogprobs = list[tuple[int, float, int]]


class GenerateRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    # Connector instructions, passed through to vLLM as kv_transfer_params. A plain dict on
    # purpose: vLLM hands it to the connector as one; parse_push/parse_pull type it there.
    kv_transfer_params: dict[str, Any] = {}


class GenerateChunk(msgspec.Struct, frozen=True, omit_defaults=True):
    """One line of a worker's answer: new tokens since the last line (None fields omitted)."""

    token_ids: list[int]  # no default: always on the wire, even when empty
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    # With finish_reason "stop": the stop_token_ids entry that ended it (None for EOS). Stop
    # strings are the conductor's (it detokenizes), so the engine never reports one here.
    stop_reason: int | None = None
    num_cached_tokens: int | None = None  # prompt tokens vLLM did not compute (local or loaded)
    error: str | None = None
    # Prefill side, last line only: the pushed KV did not land on the decode worker (why), so
    # the conductor does not make it wait for bytes that will not come.
    kv_error: str | None = None
    # With error: the engine refused the request itself as invalid (a regex, grammar or JSON
    # schema it cannot compile...), before any token. A client error, the same on every worker.
    refused: bool = False
    # Measured by the engine, on the last line only (the conductor calibrates its estimators
    # with them; see conductor/core/calibration.py). Seconds.
    queued_s: float | None = None  # waiting before first scheduled
    prefill_s: float | None = None  # first scheduled to first token: the prompt, all its chunks
    # Other prompts this engine was computing during that prefill (mooncake/engine/prefill_overlap.py):
    # prefill_s is a calibration sample only when this is 0. None: not counted.
    prefill_concurrent: int | None = None
    # Prompt tokens loaded from a KVCache pool (this node's or a peer's), counted in
    # num_cached_tokens: prefill_s includes their load, so it is no sample of compute alone.
    prefill_loaded_tokens: int | None = None
    decode_step_s: float | None = None  # mean time per generated token after the first
    decode_concurrent: int | None = None  # the same for the decode steps (first to last token)
    # Only when the request asked for them (omitted otherwise: no wire cost). One entry per
    # token in token_ids; the prompt's (None for its first token) on the line(s) where vLLM
    # produced them, in order.
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


class AbortRequest(msgspec.Struct, frozen=True):
    """Body of POST /internal/abort."""

    request_id: str


class DropRequest(msgspec.Struct, frozen=True):
    """Body of POST /internal/kv_drop: free KV pushed for a request that will not decode here."""

    transfer_id: str


class WorkerHealth(msgspec.Struct, frozen=True):
    """A worker's GET /health answer (200 ready, 503 starting or failed; same body)."""

    instance_id: str = ""
    role: str = ""  # "prefill" | "decode" | "both"
    model: str = ""
    kv_address: str = ""
    status: str = "unknown"  # "starting" | "ready" | "failed" | "draining" (SIGTERM, mooncake/drain.py)
    error: str | None = None
    cluster_token_accepted: bool | None = None
    """Whether the caller's X-Mooncake-Cluster-Token would open the internal API (None: the
    worker runs without a token). /health itself is open, for probes."""
    pool_peer: str | None = None
    """Where other nodes reach this worker's KVCache pool: its messenger PeerInfo as JSON, passed
    on opaque in a FetchParams (None: no pool, or one that does not serve other nodes)."""
    chunk_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Its engine's new tokens per step (vLLM's max_num_batched_tokens; 0: not said, as from an
    older worker): what the scheduler prices a prefill beside its running batch by."""


# One encoder and one decoder per message: built once, reused for every request and line.
ENCODER = msgspec.json.Encoder()
REQUEST_DECODER = msgspec.json.Decoder(GenerateRequest)
CHUNK_DECODER = msgspec.json.Decoder(GenerateChunk)
ABORT_DECODER = msgspec.json.Decoder(AbortRequest)
DROP_DECODER = msgspec.json.Decoder(DropRequest)
HEALTH_DECODER = msgspec.json.Decoder(WorkerHealth)


def encode_chunk_line(chunk: GenerateChunk) -> bytes:
    """One NDJSON line of a worker's answer."""
    return ENCODER.encode(chunk) + b"\n"


# -- kv_transfer_params: what the conductor tells each side's connector ---------------------------
#
# The conductor picks one transfer id per request and sends it to both sides, because vLLM may
# rename request ids internally. The producer (prefill) side pushes the prompt's KV to the
# consumer's address under that id; the consumer (decode) side waits for it under the same id.

PRODUCER_KEY = "mooncake_push"
CONSUMER_KEY = "mooncake_pull"
FETCH_KEY = "mooncake_fetch"
# Back from the pool connector when a request finishes (vLLM hands it to the worker on the last
# RequestOutput): the prompt tokens it loaded from a KVCache pool, this node's or a peer's.
LOADED_TOKENS_KEY = "mooncake_loaded_tokens"


class BadTransferParams(ValueError):
    """kv_transfer_params carried a mooncake_push/mooncake_pull entry of the wrong shape."""


class PushParams(msgspec.Struct, frozen=True):
    """Prefill side: after computing the prompt, push its KV to `dest` as `transfer_id`."""

    transfer_id: str
    dest: str  # HOST:PORT of the decode worker's KV receiver
    num_tokens: int  # prompt tokens whose KV is pushed
    # Leading prompt blocks the decode worker already holds (the conductor's prefix index): not
    # sent. If D evicted them meanwhile, its load fails and vLLM recomputes (never wrong text).
    skip_blocks: int = 0

    def to_params(self) -> dict[str, Any]:
        return {PRODUCER_KEY: msgspec.to_builtins(self)}


class PullParams(msgspec.Struct, frozen=True):
    """Decode side: the first `num_tokens` prompt tokens' KV arrives as `transfer_id`."""

    transfer_id: str
    num_tokens: int
    wait_timeout_s: float = 30.0  # then give up and recompute the prompt locally

    def to_params(self) -> dict[str, Any]:
        return {CONSUMER_KEY: msgspec.to_builtins(self)}


class FetchParams(msgspec.Struct, frozen=True):
    """Prefill side, before computing (Algorithm 1's fetch_from): bring the prompt's first
    `num_tokens` tokens' blocks from the pool at `peer` (its WorkerHealth.pool_peer) into this
    node's pool, then load them instead of computing them."""

    peer: str
    num_tokens: int

    def to_params(self) -> dict[str, Any]:
        return {FETCH_KEY: msgspec.to_builtins(self)}


def parse_fetch(params: dict[str, Any] | None) -> FetchParams | None:
    """The fetch instruction in `params`, or None if there is none."""
    return _parse(params, FETCH_KEY, FetchParams)


def parse_push(params: dict[str, Any] | None) -> PushParams | None:
    """The producer instruction in `params`, or None if there is none."""
    return _parse(params, PRODUCER_KEY, PushParams)


def parse_pull(params: dict[str, Any] | None) -> PullParams | None:
    """The consumer instruction in `params`, or None if there is none."""
    return _parse(params, CONSUMER_KEY, PullParams)


def _parse(params: dict[str, Any] | None, key: str, kind: type[Any]) -> Any:
    raw = (params or {}).get(key)
    if not raw:
        return None
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise BadTransferParams(f"kv_transfer_params[{key!r}]: {exc}") from None


# -- between the connectors: the prefill's rendezvous with the decode worker and its per-layer notes --
#
# The bytes themselves travel as slices of the transfer engine (messenger/), straight from the
# prefill's paged cache into the decode worker's staging arena; these small messages say where.

class KVHello(msgspec.Struct, frozen=True, tag="hello"):
    """Ask a decode worker's engine for its PeerInfo (answered as msgspec JSON)."""


class KVReserve(msgspec.Struct, frozen=True, tag="reserve"):
    """Reserve staging room for a transfer's blocks [first_block, first_block + num_blocks) of every
    layer. `layers`: (name, dtype, one block's shape) per layer, which must match the decode
    worker's cache (checked here, before any byte moves)."""

    transfer_id: str
    first_block: int
    num_blocks: int
    block_bytes: int
    layers: list[tuple[str, str, list[int]]]


class KVReserved(msgspec.Struct, frozen=True):
    """The answer to KVReserve: write layer L's block B at `offset` + (L * num_blocks + B -
    first_block) * block_bytes of `region`; or `error`."""

    region: str = ""
    offset: int = 0
    error: str | None = None


class KVLayerNote(msgspec.Struct, frozen=True, array_like=True):
    """Rides on each layer's batch: blocks [first_block, end_block) of `layer` of the transfer
    landed, in the slot at `slot` (KVReserved.offset), which tells a retried transfer's producer
    from the one before it (-1: not named)."""

    transfer_id: str
    layer: int
    first_block: int
    end_block: int
    slot: int = -1


KV_CALL_ENCODER = msgspec.json.Encoder()
KV_CALL_DECODER = msgspec.json.Decoder(KVHello | KVReserve)
KV_RESERVED_DECODER = msgspec.json.Decoder(KVReserved)
KV_NOTE_DECODER = msgspec.json.Decoder(KVLayerNote)
