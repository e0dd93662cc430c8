"""Minimal Prometheus text-format instruments, owned by whoever creates them (no global registry)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@dataclass
class Counter:
    name: str
    help: str
    values: dict[tuple[tuple[str, str], ...], float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(dict(k))} {v:g}" for k, v in sorted(self.values.items())]
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        lines += [f'{self.name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.total}', f"{self.name}_sum {self.sum:.6f}",
                  f"{self.name}_count {self.total}"]
        return lines


def gauge(name: str, help: str, value: float, **labels: str) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name}{_labels(labels)} {value:g}"]


def gauge_family(name: str, help: str, label: str, values: dict[str, float]) -> list[str]:
    """One gauge with a sample per label value. HELP and TYPE appear once: Prometheus refuses a
    scrape that repeats them for the same metric name."""
    return [f"# HELP {name} {help}", f"# TYPE {name} gauge",
            *(f"{name}{_labels({label: key})} {value:g}" for key, value in sorted(values.items()))]
