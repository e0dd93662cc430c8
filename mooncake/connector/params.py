"""What the conductor puts in `kv_transfer_params`, and how the connector reads it.

The conductor picks one transfer id per request and sends it to both sides, because vLLM may
rename request ids internally. The producer (prefill) side pushes the prompt's KV to the
consumer's address under that id; the consumer (decode) side waits for it under the same id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
