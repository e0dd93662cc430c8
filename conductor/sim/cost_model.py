"""The simulator's "physics": how long things really take on a simulated instance.

The truth is the same fitted formulas the scheduler predicts with (estimators.py), each
draw multiplied by lognormal noise, so the scheduler's predictions are right on average and
wrong per request, as on a real cluster. Nothing here knows about policies.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from conductor.core.estimators import Estimators


@dataclass(frozen=True, slots=True)
class CostModelConfig:
    noise_sigma: float = 0.1
    """Lognormal sigma of every duration (0.1 = about +-10 %)."""
    kv_handoff_s: float = 0.005
    """Delay from prefill end to the KV being usable on the decode instance: with layer-wise
    streaming only the last layer's KV is still in flight when prefill ends."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.noise_sigma < 2:
            raise ValueError(f"noise_sigma must be in [0, 2), got {self.noise_sigma}")
        if self.kv_handoff_s < 0:
            raise ValueError("kv_handoff_s must be >= 0")


class CostModel:
    """Draws noisy durations. Mutable only through its private random generator."""

    def __init__(self, est: Estimators, config: CostModelConfig) -> None:
        self.est, self.config = est, config
        self._rng = random.Random(config.seed)
        # Mean-one lognormal, so noise does not bias the load.
        self._mu = -config.noise_sigma ** 2 / 2

    def _noise(self) -> float:
        s = self.config.noise_sigma
        return math.exp(self._rng.gauss(self._mu, s)) if s else 1.0

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        return self.est.prefill_s(prompt_tokens, cached_tokens) * self._noise()

    def decode_step_s(self, batch_size: int, kv_tokens: int) -> float:
        return self.est.tbt_s(batch_size, kv_tokens) * self._noise()

    def transfer_s(self, n_tokens: int, bandwidth_Bps: float) -> float:
        return self.est.transfer_latency_s + n_tokens * self.est.kv_bytes_per_token / bandwidth_Bps * self._noise()
