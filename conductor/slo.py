"""Per-request priority and SLOs: what a request asks for, checked against what the operator allows.

A request belongs to one SLO class: the operator's classes (`--slo-class`, SchedulerConfig
.slo_classes) plus `default` (--ttft-slo, --tbt-slo, priority 0). It names one with the header
X-Mooncake-SLO-Class, or gets `default`. It may then set its own priority (body `priority`, as
vLLM's OpenAI server takes it, or X-Mooncake-Priority; lower is more important) and its own SLOs
(X-Mooncake-SLO-TTFT-Ms, X-Mooncake-SLO-TBT-Ms, or the body's
`mooncake_slo: {"ttft_ms": .., "tbt_ms": ..}`), each within the operator's bounds (SLOBounds):
a value outside them, or one given twice with two values, is refused (400) naming it. What it ends up
with is a RequestSLO: the scheduling core admits it by those SLOs and priority
(conductor/core/admission.py limits_for), and the metrics carry its class, which, unlike a
free-form SLO, has few values.

Any client may name any class: classes are not tied to API keys, so a class more important than
`default` is open to every client (the --slo-class help says so). Priority acts on admission
only; it is not passed to the engines, whose queues stay first come, first served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from conductor.core.config import SchedulerConfig, SLOClass
from mooncake import defaults

CLASS_HEADER = "X-Mooncake-SLO-Class"
PRIORITY_HEADER = "X-Mooncake-Priority"
TTFT_HEADER = "X-Mooncake-SLO-TTFT-Ms"
TBT_HEADER = "X-Mooncake-SLO-TBT-Ms"
UNKNOWN_CLASS = "unknown"
"""The metrics' slo_class of a request refused for naming a class that does not exist (its name
is the client's, unbounded, so it is not a label)."""


class SLOError(ValueError):
    """A request's priority or SLO that the server refuses (the caller answers 400 with param, code)."""

    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class SLOBounds:
    """What a request may ask for itself (a named class is the operator's own, unbounded)."""

    ttft_s: tuple[float, float] = defaults.SLO_TTFT_RANGE_S
    """Lowest and highest TTFT SLO a request may set, seconds."""
    tbt_s: tuple[float, float] = defaults.SLO_TBT_RANGE_S
    """Lowest and highest TBT SLO a request may set, seconds."""
    priority: tuple[int, int] = defaults.PRIORITY_RANGE
    """Most and least important priority a request may set (lower is more important)."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tbt_s"):
            low, high = getattr(self, name)
            if not (0 < low <= high and math.isfinite(high)):
                raise ValueError(f"SLO bounds {name}: need 0 < min <= max, finite, got {low}:{high}")
        if self.priority[0] > self.priority[1]:
            raise ValueError(f"priority bounds: need min <= max, got {self.priority[0]}:{self.priority[1]}")


@dataclass(frozen=True, slots=True)
class RequestSLO:
    """One request's class, priority and SLOs, as the conductor schedules and measures it."""

    slo_class: str
    priority: int
    ttft_s: float
    tbt_s: float

    @classmethod
    def of(cls, c: SLOClass) -> RequestSLO:
        """A request of class `c` that sets nothing itself."""
        return cls(c.name, c.priority, c.ttft_slo_s, c.tbt_slo_s)


@dataclass(frozen=True)
class SLOPolicy:
    """The classes a request can name (default included) and the bounds of its own values."""

    classes: Mapping[str, SLOClass]
    bounds: SLOBounds = field(default_factory=SLOBounds)

    @classmethod
    def of(cls, scheduler: SchedulerConfig, bounds: SLOBounds) -> SLOPolicy:
        """`default` is the scheduler's own SLOs at priority 0; the others, the operator's."""
        classes = {defaults.DEFAULT_SLO_CLASS: default_class(scheduler)}
        classes.update((c.name, c) for c in scheduler.slo_classes)
        return cls(classes, bounds)

    def label(self, headers: Mapping[str, str]) -> str:
        """The slo_class metrics label of a request with these headers, before it is resolved."""
        name = headers.get(CLASS_HEADER)
        if name is None:
            return defaults.DEFAULT_SLO_CLASS
        return name if name in self.classes else UNKNOWN_CLASS

    def resolve(self, headers: Mapping[str, str], priority: int | None = None, ttft_ms: float | None = None,
                tbt_ms: float | None = None) -> RequestSLO:
        """The request's RequestSLO from its headers and body fields (priority, mooncake_slo's
        ttft_ms and tbt_ms); an SLOError naming the field that is out of bounds, malformed,
        or given by both with two values."""
        name = headers.get(CLASS_HEADER, defaults.DEFAULT_SLO_CLASS)
        base = self.classes.get(name)
        if base is None:
            raise SLOError(f"unknown SLO class {name!r}; this server has {sorted(self.classes)}",
                           param=CLASS_HEADER, code="unknown_slo_class")
        b = self.bounds
        prio = _one_of("priority", priority, PRIORITY_HEADER, _header(headers, PRIORITY_HEADER, int))
        if prio is not None and not b.priority[0] <= prio <= b.priority[1]:
            param = "priority" if priority is not None else PRIORITY_HEADER
            raise SLOError(f"{param} must be in [{b.priority[0]}, {b.priority[1]}] on this server (lower is more "
                           f"important), got {prio}", param=param, code="priority_out_of_bounds")
        ttft = _ms_within("mooncake_slo.ttft_ms", ttft_ms, TTFT_HEADER, headers, b.ttft_s)
        tbt = _ms_within("mooncake_slo.tbt_ms", tbt_ms, TBT_HEADER, headers, b.tbt_s)
        return RequestSLO(name, base.priority if prio is None else prio,
                          base.ttft_slo_s if ttft is None else ttft, base.tbt_slo_s if tbt is None else tbt)


def default_class(scheduler: SchedulerConfig) -> SLOClass:
    return SLOClass(defaults.DEFAULT_SLO_CLASS, scheduler.ttft_slo_s, scheduler.tbt_slo_s, 0)


def parse_slo_class(spec: str) -> SLOClass:
    """NAME:TTFT_MS:TBT_MS:PRIORITY (the --slo-class option) -> SLOClass; ValueError says why not."""
    parts = spec.split(":")
    if len(parts) != 4 or not parts[0]:
        raise ValueError(f"--slo-class wants NAME:TTFT_MS:TBT_MS:PRIORITY, got {spec!r}")
    name, ttft, tbt, priority = parts
    if name == defaults.DEFAULT_SLO_CLASS:
        raise ValueError(f"--slo-class cannot redefine {name!r}: its SLOs are --ttft-slo and --tbt-slo, "
                         f"its priority 0")
    try:
        return SLOClass(name, float(ttft) / 1000, float(tbt) / 1000, int(priority))
    except ValueError as exc:
        raise ValueError(f"--slo-class {spec!r}: {exc}") from None


def parse_range(spec: str, kind: type, what: str) -> tuple:
    """MIN:MAX -> (MIN, MAX) of `kind`; ValueError says why not."""
    low, sep, high = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        return kind(low), kind(high)
    except ValueError:
        raise ValueError(f"{what} wants MIN:MAX, got {spec!r}") from None


def _header(headers: Mapping[str, str], name: str, kind: type):
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = kind(raw.strip())
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise SLOError(f"header {name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}",
                       param=name, code="invalid_value")
    return value


def _one_of(body_name: str, body_value, header_name: str, header_value):
    """The value given by the body or the header; both with two values is an SLOError."""
    if body_value is not None and header_value is not None and body_value != header_value:
        raise SLOError(f"{body_name} is {body_value} in the body but {header_value} in {header_name}; "
                            f"give one", param=body_name, code="conflicting_values")
    return body_value if body_value is not None else header_value


def _ms_within(body_name: str, body_ms: float | None, header_name: str, headers: Mapping[str, str],
               bounds_s: tuple[float, float]) -> float | None:
    ms = _one_of(body_name, body_ms, header_name, _header(headers, header_name, float))
    if ms is None:
        return None
    low, high = bounds_s
    if not low * 1000 <= ms <= high * 1000:
        param = body_name if body_ms is not None else header_name
        raise SLOError(f"{param} must be in [{low * 1000:g}, {high * 1000:g}] ms on this server, got {ms:g}",
                       param=param, code="slo_out_of_bounds")
    return ms / 1000
