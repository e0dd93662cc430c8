"""Typed messages between the conductor and the workers' internal HTTP API.

The conductor is the only public API. Workers take token ids (the conductor tokenizes) and
answer with token ids (the conductor detokenizes), as newline-delimited JSON. Plain dataclasses
with explicit to_dict/from_dict; pydantic stays at the public HTTP edge.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Sampling":
        raw = dict(raw)
        raw["stop_token_ids"] = tuple(raw.get("stop_token_ids") or ())
        raw["logit_bias"] = tuple((int(t), float(b)) for t, b in raw.get("logit_bias") or ())
        return cls(**raw)


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    # Connector instructions, passed through to vLLM as kv_transfer_params (see connector/params.py).
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerateRequest":
        ids = raw["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return cls(
            request_id=str(raw["request_id"]),
            prompt_token_ids=ids,
            sampling=Sampling.from_dict(raw["sampling"]),
            kv_transfer_params=dict(raw.get("kv_transfer_params") or {}),
        )


@dataclass(frozen=True)
class GenerateChunk:
    """One line of a worker's answer: new tokens since the last line."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    num_cached_tokens: int | None = None  # prompt tokens vLLM did not compute (local or loaded)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerateChunk":
        return cls(
            token_ids=list(raw.get("token_ids") or []),
            finish_reason=raw.get("finish_reason"),
            num_cached_tokens=raw.get("num_cached_tokens"),
            error=raw.get("error"),
        )


# -- kv_transfer_params: what the conductor tells each side's connector ---------------------------
#
# The conductor picks one transfer id per request and sends it to both sides, because vLLM may
# rename request ids internally. The producer (prefill) side pushes the prompt's KV to the
# consumer's address under that id; the consumer (decode) side waits for it under the same id.

PRODUCER_KEY = "mooncake_push"
CONSUMER_KEY = "mooncake_pull"


@dataclass(frozen=True)
class PushParams:
    """Prefill side: after computing the prompt, push its KV to `dest` as `transfer_id`."""

    transfer_id: str
    dest: str  # HOST:PORT of the decode worker's KV receiver
    num_tokens: int  # prompt tokens whose KV is pushed

    def to_params(self) -> dict[str, Any]:
        return {PRODUCER_KEY: {"transfer_id": self.transfer_id, "dest": self.dest,
                               "num_tokens": self.num_tokens}}


@dataclass(frozen=True)
class PullParams:
    """Decode side: the first `num_tokens` prompt tokens' KV arrives as `transfer_id`."""

    transfer_id: str
    num_tokens: int
    wait_timeout_s: float = 30.0  # then give up and recompute the prompt locally

    def to_params(self) -> dict[str, Any]:
        return {CONSUMER_KEY: {"transfer_id": self.transfer_id, "num_tokens": self.num_tokens,
                               "wait_timeout_s": self.wait_timeout_s}}


def parse_push(params: dict[str, Any] | None) -> PushParams | None:
    raw = (params or {}).get(PRODUCER_KEY)
    if not raw:
        return None
    return PushParams(str(raw["transfer_id"]), str(raw["dest"]), int(raw["num_tokens"]))


def parse_pull(params: dict[str, Any] | None) -> PullParams | None:
    raw = (params or {}).get(CONSUMER_KEY)
    if not raw:
        return None
    return PullParams(str(raw["transfer_id"]), int(raw["num_tokens"]),
                      float(raw.get("wait_timeout_s", 30.0)))
