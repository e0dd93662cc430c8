"""Time estimators: prefill, queue, KV transfer and decode TBT.

Each is a small physical formula whose coefficients are fitted (non-negative least squares,
relative error) from a profile table, so the same code prices a 135M model on a CPU and a
70B model on eight GPUs:

  T_prefill(L, p) = c0 + c1*n + c2*n*(p + n/2) + c3*p      n = L - p new tokens
      (fixed cost, per-token linear layers, causal attention over the context, loading the
       p cached tokens' KV)
  T_queue(i)      = the instance's queued predicted prefill seconds
  T_transfer(t)   = latency + (pending bytes on the sender + t*kv_bytes) / bandwidth
      (the sender's link is a FIFO: what it is already sending delays us)
  TBT(n, K)       = d0 + d1*n + d2*K      n sequences, K KV tokens in the batch
      (weights read once per step, per-sequence compute, KV read)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from conductor.core.profile_table import ProfileTable
from conductor.core.types import InstanceState


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on relative error with coefficients >= 0 (drop negatives, refit)."""
    w = 1.0 / y
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


@dataclass(frozen=True, slots=True)
class PrefillModel:
    c0: float
    c1: float
    c2: float
    c3: float

    def __post_init__(self) -> None:
        if min(self.c0, self.c1, self.c2, self.c3) < 0:
            raise ValueError(f"prefill coefficients must be >= 0: {self}")

    def seconds(self, prompt_tokens: int, cached_tokens: int) -> float:
        new = max(prompt_tokens - cached_tokens, 0)
        return self.c0 + new * (self.c1 + self.c2 * (cached_tokens + new / 2)) + self.c3 * cached_tokens

    @classmethod
    def fit(cls, table: ProfileTable) -> PrefillModel:
        rows = np.array([(r.prompt_tokens, r.cached_tokens, r.seconds) for r in table.prefill], dtype=float)
        L, p, y = rows.T
        n = L - p
        x = np.stack([np.ones_like(n), n, n * (p + n / 2), p], axis=1)
        return cls(*map(float, _nnls_relative(x, y)))


@dataclass(frozen=True, slots=True)
class DecodeModel:
    d0: float
    d1: float
    d2: float

    def __post_init__(self) -> None:
        if min(self.d0, self.d1, self.d2) < 0 or self.d0 + self.d1 <= 0:
            raise ValueError(f"decode coefficients must be >= 0 with a positive step time: {self}")

    def step_seconds(self, batch_size: int, kv_tokens: int) -> float:
        return self.d0 + self.d1 * batch_size + self.d2 * kv_tokens

    @classmethod
    def fit(cls, table: ProfileTable) -> DecodeModel:
        rows = np.array([(r.batch_size, r.kv_tokens, r.step_seconds) for r in table.decode], dtype=float)
        b, k, y = rows.T
        x = np.stack([np.ones_like(b), b, k], axis=1)
        return cls(*map(float, _nnls_relative(x, y)))


DRAM_LOAD_BPS = 3.5e9
"""Bytes per second a worker loads prefix blocks from its pool's DRAM tier into the paged cache
(benchmarks/store_bench.py: local gets of 4 MiB, 3.2-3.7 GB/s on the 2-core CPU machine)."""
SSD_LOAD_BPS = 2.0e9
"""The same from its SSD tier, checksums verified (store_bench: 2.1 GB/s reads of 4 MiB blocks)."""


@dataclass(frozen=True, slots=True)
class Estimators:
    """All four estimators, fitted from one profile table, and the pool tiers' load rates."""

    prefill: PrefillModel
    decode: DecodeModel
    kv_bytes_per_token: int
    transfer_latency_s: float = 0.001
    dram_load_Bps: float = DRAM_LOAD_BPS
    ssd_load_Bps: float = SSD_LOAD_BPS

    def __post_init__(self) -> None:
        if (self.kv_bytes_per_token <= 0 or self.transfer_latency_s < 0 or self.dram_load_Bps <= 0
                or self.ssd_load_Bps <= 0):
            raise ValueError(f"bad estimator parameters: {self}")

    def pool_load_s(self, tier_tokens: Mapping[str, int]) -> float:
        """Seconds to load prefix tokens held only in an instance's KVCache pool into its engine,
        by tier ("dram"; any other tier, SSD included, at the SSD rate: the slowest priced)."""
        seconds = 0.0
        for tier, tokens in tier_tokens.items():
            rate = self.dram_load_Bps if tier == "dram" else self.ssd_load_Bps
            seconds += tokens * self.kv_bytes_per_token / rate
        return seconds

    @classmethod
    def from_profile(cls, table: ProfileTable, transfer_latency_s: float = 0.001) -> Estimators:
        return cls(PrefillModel.fit(table), DecodeModel.fit(table), table.kv_bytes_per_token, transfer_latency_s)

    def prefill_s(self, prompt_tokens: int, cached_tokens: int, scale: float = 1.0) -> float:
        """scale: the instance's calibrated speed (InstanceState.prefill_scale); 1 is the prior."""
        return self.prefill.seconds(prompt_tokens, cached_tokens) * scale

    @staticmethod
    def queue_s(instance: InstanceState) -> float:
        return max(instance.queued_prefill_s, 0.0)

    def transfer_s(self, n_tokens: int, sender: InstanceState) -> float:
        """Time to pull n_tokens of KV from sender, behind what it is already sending."""
        if n_tokens <= 0:
            return 0.0
        nbytes = n_tokens * self.kv_bytes_per_token
        return self.transfer_latency_s + (sender.pending_send_bytes + nbytes) / sender.bandwidth_Bps

    def tbt_s(self, batch_size: int, kv_tokens: int, scale: float = 1.0) -> float:
        """scale: the instance's calibrated speed (InstanceState.decode_scale); 1 is the prior."""
        return self.decode.step_seconds(batch_size, kv_tokens) * scale


class DecodeTimeMeter:
    """The mean decode duration t_d that prediction-based admission assumes, measured by
    Little's law: t_d = (time-average number of sequences decoding) / (completions per second),
    both exponentially weighted with time constant tau_s.

    The plain mean of completed decode durations is biased low whenever the decode pool is
    filling (at start, or after a burst): the short requests finish first, while the long
    ones still running are not counted. With outputs of ~100 s that bias lasts minutes and
    makes the forecast expect completions that do not come. Little's law counts the running
    ones through the occupancy, so it is exact in steady state and errs high (conservative)
    while the pool fills. Pure: the caller passes the clock; no I/O.
    """

    __slots__ = ("tau_s", "min_completions", "_t", "_n", "_area", "_rate", "_count")

    def __init__(self, tau_s: float = 300.0, min_completions: int = 20) -> None:
        if not tau_s > 0 or min_completions < 1:
            raise ValueError("tau_s must be positive and min_completions >= 1")
        self.tau_s, self.min_completions = tau_s, min_completions
        self._t, self._n, self._area, self._rate, self._count = 0.0, 0, 0.0, 0.0, 0

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            decay = math.exp(-dt / self.tau_s)
            self._area = self._area * decay + self._n * self.tau_s * (1.0 - decay)
            self._rate *= decay
            self._t = now

    def set_decoding(self, now: float, n: int) -> None:
        """The number of sequences decoding changed to n at time now."""
        self._advance(now)
        self._n = n

    def completed(self, now: float, k: int = 1) -> None:
        """k sequences finished decoding at time now."""
        self._advance(now)
        self._rate += k
        self._count += k

    def mean_decode_s(self, now: float) -> float | None:
        """t_d, or None until min_completions sequences have finished."""
        self._advance(now)
        if self._count < self.min_completions or self._rate <= 0:
            return None
        return self._area / self._rate
