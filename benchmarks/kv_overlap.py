"""How much of a prefill's KV transfer stayed hidden behind its compute, layer by layer (the
Mooncake paper's Figure 5: layer-wise KV streaming overlapped with prefill compute), from the
`layer_timeline` the prefill worker serves on `/internal/kv_stats`. Pure: data in, numbers out.

One transfer is a list of (computed_s, landed_s) per layer, in layer order: when the prefill
finished computing the layer, and when its KV had landed on the decode worker. Both are
time.monotonic() readings; CLOCK_MONOTONIC is one clock for every process of a host (across
hosts they would need aligning first).

The model of the wire: a layer's bytes start moving once the layer is computed and the layers
before it have landed (one ordered stream), so its wire time is
[max(computed_i, landed of the earlier layers), landed_i]. Compute ends at the latest
computed_s. Wire time before that is hidden behind compute; wire time after it is exposed: the
prefill's answer waits for it, so it adds to TTFT. Per layer:

    exposed_i = max(0, landed_i - max(compute_end, landed of the earlier layers))
    hidden_i  = wire_i - exposed_i

so the layers' exposed times add up to the exposed tail, max(landed) - compute_end.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferOverlap:
    """One pushed transfer, split into hidden and exposed wire time per layer (seconds)."""

    transfer_id: str
    num_tokens: int
    computed: tuple[float, ...]
    landed: tuple[float, ...]
    wire: tuple[float, ...]
    exposed: tuple[float, ...]

    @property
    def compute_end(self) -> float:
        return max(self.computed)

    @property
    def hidden(self) -> tuple[float, ...]:
        return tuple(w - e for w, e in zip(self.wire, self.exposed))

    @property
    def wire_s(self) -> float:
        return sum(self.wire)

    @property
    def exposed_s(self) -> float:
        """The exposed tail: how long the last landing came after the end of compute."""
        return sum(self.exposed)

    @property
    def hidden_fraction(self) -> float:
        """Share of the wire time spent while the prefill was still computing (1.0: all hidden)."""
        return 1.0 - self.exposed_s / self.wire_s if self.wire_s > 0 else 1.0


def overlap(layers: list[tuple[float, float]], transfer_id: str = "", num_tokens: int = 0) -> TransferOverlap:
    """Split one transfer's per-layer (computed_s, landed_s) into wire, hidden and exposed time."""
    if not layers:
        raise ValueError(f"transfer {transfer_id!r} has no layers")
    computed = tuple(float(c) for c, _ in layers)
    landed = tuple(float(t) for _, t in layers)
    compute_end = max(computed)
    wire, exposed = [], []
    earlier_landed = float("-inf")
    for c, t in zip(computed, landed):
        start = max(c, earlier_landed)
        wire.append(max(0.0, t - start))
        exposed.append(max(0.0, t - max(compute_end, start)))
        earlier_landed = max(earlier_landed, t)
    return TransferOverlap(transfer_id, num_tokens, computed, landed, tuple(wire), tuple(exposed))


def timeline_of(kv_stats: dict) -> list[dict] | None:
    """The `layer_timeline` of a prefill worker's /internal/kv_stats body (at the top level or
    inside its connector `stats`), or None when the worker does not serve one."""
    for place in (kv_stats, kv_stats.get("stats")):
        if isinstance(place, dict) and isinstance(place.get("layer_timeline"), list):
            return place["layer_timeline"]
    return None


def overlaps(timeline: list[dict]) -> list[TransferOverlap]:
    """Every transfer of a timeline that has layers, in the timeline's order."""
    out = []
    for entry in timeline:
        layers = entry.get("layers") or []
        if layers:
            out.append(overlap([(c, t) for c, t in layers], str(entry.get("transfer_id", "")),
                               int(entry.get("num_tokens", 0))))
    return out


def by_length(transfers: list[TransferOverlap], lengths: list[int], keep: int,
              tolerance: float = 0.1) -> dict[int, list[TransferOverlap]]:
    """The last `keep` transfers of each prompt length: a transfer belongs to the nearest length
    within `tolerance` (its num_tokens may differ from the prompt's by a token or a block)."""
    groups: dict[int, list[TransferOverlap]] = {n: [] for n in lengths}
    for t in transfers:
        nearest = min(lengths, key=lambda n: abs(t.num_tokens - n))
        if abs(t.num_tokens - nearest) <= tolerance * nearest:
            groups[nearest].append(t)
    return {n: g[-keep:] if keep > 0 else [] for n, g in groups.items()}


@dataclass(frozen=True)
class LengthSummary:
    """Medians over the transfers of one prompt length (seconds, except the fraction)."""

    num_tokens: int
    transfers: int
    layers: int
    wire_s: float
    exposed_s: float
    hidden_fraction: float
    exposed_per_layer: tuple[float, ...]
    """Median exposed time of each layer; empty when the transfers' layer counts differ."""


def summarize(num_tokens: int, transfers: list[TransferOverlap]) -> LengthSummary | None:
    if not transfers:
        return None
    counts = {len(t.wire) for t in transfers}
    per_layer = ()
    if len(counts) == 1:
        per_layer = tuple(statistics.median(col) for col in zip(*(t.exposed for t in transfers)))
    return LengthSummary(num_tokens, len(transfers), max(counts),
                         statistics.median(t.wire_s for t in transfers),
                         statistics.median(t.exposed_s for t in transfers),
                         statistics.median(t.hidden_fraction for t in transfers), per_layer)
