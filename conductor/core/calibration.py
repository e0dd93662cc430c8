"""Self-calibrating estimators: each instance's prior, scaled to what it is measured doing.

The profile table gives the shape of the cost (how prefill grows with prompt and prefix, how a
decode step grows with batch and KV); the hardware actually running may be uniformly faster or
slower (another dtype, another core count, a loaded host). So the fit keeps the prior's shape
and learns one multiplicative scale per instance for prefill and one for the decode step:

  scale = exp(shrink * median(log(measured / prior prediction)) over the last `window` samples)
  shrink = n / (n + prior_weight)       (few samples: stay near the prior)
  clamped to [min_scale, max_scale]

A third fit closes the loop on what admission is judged by: the TTFT the conductor measured for
a request against the TTFT it predicted when it routed it (`observe_ttft`). The prefill fit learns
the engine's speed from prompts it computed (nearly) alone; under a standing queue on a busy host
(two engines, the conductor and the clients on a few cores) the prompts run slower than that,
and the queue the ledger prices drains slower: a loaded cluster was priced 1.3-1.5x too fast
(benchmarks/RESULTS.md, the simulator against the live cluster). The TTFT residual is the median
of measured / predicted TTFT, the prediction taken without the residual it was priced with, so it
is a direct fit, not an integrator that could swing. It multiplies the instance's prefill price
(and so the queue its new work adds), within [min_residual, max_residual]: it corrects the prior's
and the prefill fit's misses, it does not replace them. Only predictions of at least
`min_ttft_sample_s` are samples: a short prompt's TTFT is mostly fixed overhead (HTTP,
tokenizing), which a multiplicative residual would misread.

A median, not a mean: one sample 10x off (a GC pause, a preempted step) moves it by one rank.
A scaled model is still a PrefillModel / DecodeModel (every coefficient times the scale), so the
calibrated model is concrete and printable. Pure: no clock is needed (the window is by count),
no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from conductor.core.estimators import DecodeModel, Estimators, PrefillModel
from conductor.core.profile_table import ProfileTable


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    window: int = 64
    """Samples the fit looks at (the most recent ones)."""
    prior_weight: float = 4.0
    """n0: with n samples the measured log-scale counts n / (n + n0), the prior the rest."""
    min_scale: float = 0.1
    max_scale: float = 10.0
    min_residual: float = 1 / 3
    """The TTFT residual's clamp (module doc): a correction of the prefill fit, not a second one."""
    max_residual: float = 3.0
    min_ttft_sample_s: float = 0.25
    """A request's TTFT is a residual sample when its predicted TTFT was at least this (seconds)."""

    def __post_init__(self) -> None:
        if (self.window < 1 or self.prior_weight < 0 or not 0 < self.min_scale <= 1 <= self.max_scale
                or not 0 < self.min_residual <= 1 <= self.max_residual or self.min_ttft_sample_s < 0):
            raise ValueError(f"bad calibration config: {self}")


class ScaleFit:
    """A robust multiplicative fit of measured seconds to a prior's predicted seconds."""

    __slots__ = ("config", "bounds", "_log_ratios", "_pairs", "samples", "scale", "relative_error")

    def __init__(self, config: CalibrationConfig, bounds: tuple[float, float] | None = None) -> None:
        self.config = config
        self.bounds = bounds or (config.min_scale, config.max_scale)
        """The scale's clamp (min, max)."""
        self._log_ratios: deque[float] = deque(maxlen=config.window)
        self._pairs: deque[tuple[float, float]] = deque(maxlen=config.window)  # (measured, prior predicted)
        self.samples = 0
        """Samples seen in all (the window holds at most config.window of them)."""
        self.scale = 1.0
        self.relative_error: float | None = None
        """Median |measured - calibrated| / measured over the window; None before any sample."""

    def add(self, measured_s: float, predicted_s: float) -> bool:
        """One measurement against the prior's prediction for the same work. Returns False (and
        ignores it) when either is not a positive finite number of seconds."""
        if not (0 < measured_s < math.inf and 0 < predicted_s < math.inf):
            return False
        self._log_ratios.append(math.log(measured_s / predicted_s))
        self._pairs.append((measured_s, predicted_s))
        self.samples += 1
        # Refitted here, once per sample, so pricing reads a plain float.
        cfg = self.config
        n = len(self._log_ratios)
        shrink = n / (n + cfg.prior_weight)
        scale = math.exp(shrink * statistics.median(self._log_ratios))
        self.scale = min(max(scale, self.bounds[0]), self.bounds[1])
        self.relative_error = statistics.median(abs(m - self.scale * p) / m for m, p in self._pairs)
        return True


class InstanceCalibration:
    """One instance's prefill and decode-step fits against the scheduler's prior, and its TTFT
    residual (module doc)."""

    __slots__ = ("prior", "prefill", "decode_step", "ttft_residual", "_on_change")

    def __init__(self, prior: Estimators, config: CalibrationConfig,
                 on_change: Callable[[], None] | None = None) -> None:
        self.prior = prior
        self.prefill = ScaleFit(config)
        self.decode_step = ScaleFit(config)
        self.ttft_residual = ScaleFit(config, (config.min_residual, config.max_residual))
        self._on_change = on_change
        """Called after a sample moved a scale (the cluster's pooled scales are then stale)."""

    def observe_prefill(self, prompt_tokens: int, cached_tokens: int, measured_s: float) -> bool:
        cached = min(max(cached_tokens, 0), prompt_tokens)
        return self._changed(self.prefill.add(measured_s, self.prior.prefill_s(prompt_tokens, cached)))

    def observe_decode_step(self, batch_size: float, kv_tokens: float, measured_s: float) -> bool:
        """A mean decode step measured at a (time-)mean load: fractional sizes are fine, the
        step model is linear in both."""
        return self._changed(self.decode_step.add(measured_s, self.prior.tbt_s(max(batch_size, 1), max(kv_tokens, 0))))

    def observe_ttft(self, measured_s: float, predicted_s: float, residual_priced: float) -> bool:
        """A request routed to prefill here: the TTFT measured from the routing decision to the
        first token, against the TTFT predicted then, which this instance's residual at that time
        (`residual_priced`) had multiplied. Predictions under `min_ttft_sample_s` are not samples."""
        if not (predicted_s >= self.ttft_residual.config.min_ttft_sample_s and residual_priced > 0):
            return False
        return self._changed(self.ttft_residual.add(measured_s, predicted_s / residual_priced))

    def prefill_price_scale(self) -> float:
        """What the scheduler multiplies this instance's prior prefill seconds by."""
        return self.prefill.scale * self.ttft_residual.scale

    def _changed(self, added: bool) -> bool:
        if added and self._on_change is not None:
            self._on_change()
        return added

    def prefill_model(self) -> PrefillModel:
        """The prefill model it is priced with (the TTFT residual included)."""
        m, s = self.prior.prefill, self.prefill_price_scale()
        return PrefillModel(m.c0 * s, m.c1 * s, m.c2 * s, m.c3 * s)

    def decode_model(self) -> DecodeModel:
        m, s = self.prior.decode, self.decode_step.scale
        return DecodeModel(m.d0 * s, m.d1 * s, m.d2 * s)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: prior and calibrated coefficients, scales, sample counts and errors."""
        def fit(f: ScaleFit, prior: Any, calibrated: Any) -> dict[str, Any]:
            return {"scale": f.scale, "samples": f.samples, "relative_error": f.relative_error,
                    "prior": asdict(prior), "calibrated": asdict(calibrated)}
        residual = self.ttft_residual
        return {"prefill": fit(self.prefill, self.prior.prefill, self.prefill_model()),
                "decode_step": fit(self.decode_step, self.prior.decode, self.decode_model()),
                "ttft_residual": {"scale": residual.scale, "samples": residual.samples,
                                  "relative_error": residual.relative_error}}


class Calibration:
    """Every instance's calibration, created on first sight and dropped when it leaves."""

    def __init__(self, prior: Estimators, config: CalibrationConfig | None = None) -> None:
        self.prior = prior
        self.config = config or CalibrationConfig()
        self._instances: dict[str, InstanceCalibration] = {}
        self._pooled: dict[str, float] | None = None
        """Scale by kind (_KINDS) for instances not measured yet; None: to be recomputed. Cached
        because the router reads every instance's scales for every request."""

    def instance(self, instance_id: str) -> InstanceCalibration:
        cal = self._instances.get(instance_id)
        if cal is None:
            cal = self._instances[instance_id] = InstanceCalibration(self.prior, self.config, self._invalidate)
        return cal

    def scales(self, instance_id: str) -> tuple[float, float]:
        """(prefill price scale, decode-step scale): the prefill one is the prefill fit times the
        TTFT residual. A fit with no sample yet is priced optimistically:
        the cluster's scale (the geometric mean of the measured instances') when that is below 1,
        else the prior's 1. Without that, an instance the scheduler has not tried keeps the
        prior's (pessimistic) price, loses every request to the ones measured faster, and is never
        measured; and when the measured ones are slow, the untried one is still tried first."""
        prefill = self._scale(instance_id, "prefill") * self.ttft_residual(instance_id)
        return prefill, self._scale(instance_id, "decode_step")

    def ttft_residual(self, instance_id: str) -> float:
        """The TTFT residual scales(instance_id)[0] includes."""
        return self._scale(instance_id, "ttft_residual")

    def _scale(self, instance_id: str, kind: str) -> float:
        """One fit's scale: the instance's own once it has a sample, else the pooled one."""
        fit = getattr(self._instances.get(instance_id), kind, None)
        if fit is not None and fit.samples:
            return fit.scale
        if self._pooled is None:
            self._pooled = {k: _optimistic([getattr(c, k) for c in self._instances.values()]) for k in _KINDS}
        return self._pooled[kind]

    def _invalidate(self) -> None:
        self._pooled = None

    def retain(self, instance_ids: set[str] | frozenset[str]) -> None:
        """Forget the instances not in instance_ids (they left the pool)."""
        for gone in self._instances.keys() - instance_ids:
            del self._instances[gone]
        self._invalidate()

    def items(self) -> list[tuple[str, InstanceCalibration]]:
        return sorted(self._instances.items())

    def describe(self) -> dict[str, Any]:
        return {name: cal.describe() for name, cal in self.items()}


_KINDS = ("prefill", "decode_step", "ttft_residual")  # InstanceCalibration's fits


def _optimistic(fits: list[ScaleFit]) -> float:
    """The geometric mean of the measured fits' scales if below 1, else the prior's 1."""
    mean = _geometric_mean([f.scale for f in fits if f.samples])
    return 1.0 if mean is None else min(1.0, mean)


def _geometric_mean(scales: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in scales) / len(scales)) if scales else None


def cluster_scales(estimators_doc: dict[str, Any]) -> tuple[float, float]:
    """(prefill, decode step) scale of a live cluster, from a conductor's
    `GET /internal/debug/estimators` answer (or its "instances" part): the geometric mean over the
    instances measured for each kind; 1 (the prior) for a kind none was measured for. The prefill
    one includes the TTFT residual, as the conductor prices with it (an answer from before the
    residual has none: 1)."""
    instances = estimators_doc.get("instances", estimators_doc)
    if not isinstance(instances, dict):
        raise ValueError("not a conductor's /internal/debug/estimators answer: no 'instances' object")

    def mean(kind: str, optional: bool = False) -> float:
        scales = []
        for name, fits in instances.items():
            if optional and isinstance(fits, dict) and kind not in fits:
                continue
            try:
                fit = fits[kind]
                if fit["samples"] > 0:
                    scales.append(float(fit["scale"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"instance {name!r}: no {kind} scale and samples ({exc})") from exc
            if scales and not 0 < scales[-1] < math.inf:
                raise ValueError(f"instance {name!r}: {kind} scale {scales[-1]} is not a positive number")
        return _geometric_mean(scales) or 1.0

    return mean("prefill") * mean("ttft_residual", optional=True), mean("decode_step")


def fitted_profile(table: ProfileTable, prefill_scale: float, decode_scale: float) -> ProfileTable:
    """The profile a live cluster's calibration amounts to: every prefill row's seconds times
    prefill_scale and every decode row's step times decode_scale. The fits are linear in the
    seconds, so estimators fitted from it are the calibrated ones (the simulator's input)."""
    if not (0 < prefill_scale < math.inf and 0 < decode_scale < math.inf):
        raise ValueError(f"scales must be positive, got {prefill_scale}, {decode_scale}")
    longest = max(max(r.seconds for r in table.prefill) * prefill_scale,
                  max(r.step_seconds for r in table.decode) * decode_scale)
    if longest > 1e9:  # 30 years: a fit gone wrong, and the estimators' least squares overflow
        raise ValueError(f"scales {prefill_scale:g}, {decode_scale:g} make a profile time of {longest:g} s")
    return replace(
        table, name=f"{table.name}-fitted",
        prefill=tuple(replace(r, seconds=r.seconds * prefill_scale) for r in table.prefill),
        decode=tuple(replace(r, step_seconds=r.step_seconds * decode_scale) for r in table.decode),
        assumptions={**table.assumptions, "fitted_scales": {"prefill": prefill_scale, "decode_step": decode_scale}})
