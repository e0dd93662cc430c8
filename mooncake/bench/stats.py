"""Per-request records and what a run's figures are made of. Pure: records in, summaries out.

A request attains the SLO when it completed AND its TTFT <= the TTFT SLO AND its mean time
between tokens <= the TBT SLO. A refusal (429) or an error is a miss, never a zero latency:
latency percentiles are taken over completed requests only, and say how many those were.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

OK, REFUSED, ERROR = "ok", "refused", "error"


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds from the run's start."""

    index: int
    input_length: int
    max_tokens: int
    scheduled_s: float
    """When the arrival schedule said to send it."""
    sent_s: float = math.nan
    """When the first attempt was sent: latencies count from here, retries included."""
    first_token_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    """Arrival of every chunk that carried a token (the first one included; its text may be empty)."""
    end_s: float | None = None
    tokens: int = 0
    """Tokens generated (the server's usage count when it sent one, else token chunks)."""
    tokens_from_usage: bool = False
    """Whether `tokens` is the server's usage count (else a count of token chunks, which may each
    carry several tokens: TBT is then per chunk, and a short count proves nothing)."""
    status: str = ERROR
    error: str = ""
    attempts: int = 0
    warmup: bool = False
    predicted_ttft_s: float | None = None
    """What the server's scheduler predicted this TTFT would be, when it says (our conductor does)."""

    @property
    def ttft_s(self) -> float | None:
        return self.first_token_s - self.sent_s if self.status == OK and self.first_token_s is not None else None

    @property
    def ttft_over_predicted(self) -> float | None:
        """Measured / predicted TTFT of a completed request the server predicted (1: exact)."""
        ttft = self.ttft_s
        if ttft is None or not self.predicted_ttft_s:
            return None
        return ttft / self.predicted_ttft_s

    @property
    def mean_tbt_s(self) -> float | None:
        """(last chunk - first chunk) / (tokens - 1): exact also when a chunk carries several
        tokens. None with fewer than 2 tokens (no gap to measure)."""
        if self.status != OK or self.tokens < 2 or len(self.chunk_s) < 1:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.sent_s if self.status == OK and self.end_s is not None else None

    @property
    def tbt_gaps_s(self) -> list[float]:
        return np.diff(self.chunk_s).tolist() if len(self.chunk_s) > 1 else []

    def attains(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        if self.status != OK or self.ttft_s is None or self.ttft_s > ttft_slo_s:
            return False
        tbt = self.mean_tbt_s
        return tbt is None or tbt <= tbt_slo_s

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, mean_tbt_s=self.mean_tbt_s, e2e_s=self.e2e_s)
        return d


def percentiles(values: list[float], ps: tuple[float, ...]) -> dict[str, float | None]:
    """{"p50": ..} by linear interpolation; None for every p when there are no values."""
    if not values:
        return {f"p{p:g}": None for p in ps}
    got = np.percentile(np.asarray(values, dtype=float), ps)
    return {f"p{p:g}": float(v) for p, v in zip(ps, got)}


@dataclass(frozen=True, slots=True)
class RateSummary:
    offered_rate: float
    """Requests per second the arrival schedule offered."""
    duration_s: float
    """First send to last answer (or failure)."""
    requests: int
    completed: int
    refused: int
    errors: int
    ttft_s: dict
    tbt_s: dict
    """Percentiles over completed requests of each request's mean time between tokens."""
    e2e_s: dict
    attainment: float
    """Attaining requests / all requests (refusals and errors count as misses)."""
    goodput: float
    """Attaining requests per second: the smaller of attainment x offered_rate and attaining
    requests / duration_s (the latter alone where the schedule defines no rate). Neither alone
    is honest for a short run: over duration_s, 5 requests at 5 req/s read 9.4 req/s (more than
    was offered); attainment x rate, 4 requests at 20 req/s served in 4.3 s read 20 (more than
    was served)."""
    short_outputs: int
    """Completed requests whose server's usage count is below max_tokens (EOS without ignore_eos;
    with it, such an answer is an error)."""
    without_usage: int
    """Completed requests whose server sent no usage count: their tokens and TBT are per chunk."""
    max_send_lag_s: float
    """Largest delay of a send past its schedule: large values mean the client, not the
    server, set the pace."""
    ttft_over_predicted: dict = field(default_factory=dict)
    """Percentiles of measured / predicted TTFT over completed requests the server predicted
    (empty: it predicted none); p50 near 1 means its scheduler's predictions are calibrated."""


def summarize(records: list[RequestRecord], offered_rate: float, ttft_slo_s: float,
              tbt_slo_s: float) -> RateSummary:
    done = [r for r in records if r.status == OK]
    sent = [r.sent_s for r in records if not math.isnan(r.sent_s)]
    ends = [r.end_s for r in records if r.end_s is not None]
    duration = (max(ends) - min(sent)) if sent and ends else 0.0
    good = sum(r.attains(ttft_slo_s, tbt_slo_s) for r in records)
    return RateSummary(
        offered_rate=offered_rate, duration_s=duration, requests=len(records), completed=len(done),
        refused=sum(r.status == REFUSED for r in records), errors=sum(r.status == ERROR for r in records),
        ttft_s=percentiles([r.ttft_s for r in done], (50, 90, 99)),
        tbt_s=percentiles([r.mean_tbt_s for r in done if r.mean_tbt_s is not None], (50, 90, 99)),
        e2e_s=percentiles([r.e2e_s for r in done], (50, 90)),
        attainment=good / len(records) if records else 0.0,
        goodput=_goodput(good, len(records), offered_rate, duration),
        short_outputs=sum(r.tokens_from_usage and r.tokens < r.max_tokens for r in done),
        without_usage=sum(not r.tokens_from_usage for r in done),
        max_send_lag_s=max((r.sent_s - r.scheduled_s for r in records if not math.isnan(r.sent_s)), default=0.0),
        ttft_over_predicted=_ratio_percentiles([r.ttft_over_predicted for r in done]),
    )


def _goodput(good: int, requests: int, offered_rate: float, duration_s: float) -> float:
    served = good / duration_s if duration_s > 0 else 0.0
    if not requests or not math.isfinite(offered_rate):
        return served
    return min(good / requests * offered_rate, served)


def _ratio_percentiles(ratios: list[float | None]) -> dict:
    known = [r for r in ratios if r is not None]
    return {"n": len(known), **percentiles(known, (10, 50, 90))} if known else {}


def slo_capacity(summaries: list[RateSummary], target: float) -> float | None:
    """The highest offered rate whose attainment is >= target; None when no rate meets it."""
    # A schedule with every arrival at one instant (a one-line trace) offers no defined rate.
    met = [s.offered_rate for s in summaries if s.attainment >= target and math.isfinite(s.offered_rate)]
    return max(met) if met else None


def lower_rates_missing(summaries: list[RateSummary], target: float, capacity: float | None) -> list[RateSummary]:
    """The rates below `capacity` that missed the target: attainment that is not monotonic in the
    rate (noise, a cold cache, a server that refuses early) makes the capacity a lucky rate."""
    if capacity is None:
        return []
    return sorted((s for s in summaries if s.offered_rate < capacity and s.attainment < target),
                  key=lambda s: s.offered_rate)
