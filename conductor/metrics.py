"""The conductor's own metrics: what users saw (status codes, TTFT, TBT, end-to-end latency)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mooncake.promtext import Counter, Histogram, gauge, gauge_family

_LATENCY_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_TBT_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
_RATIO = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


@dataclass
class ConductorMetrics:
    requests: Counter = field(default_factory=lambda: Counter(
        "mooncake_requests_total", "Requests answered, by endpoint and HTTP status."))
    rejections: Counter = field(default_factory=lambda: Counter(
        "mooncake_rejections_total", "Requests refused before any work, by reason."))
    routes: Counter = field(default_factory=lambda: Counter(
        "mooncake_routes_total", "Requests routed, by kind: disaggregated (prefill worker, then decode "
        "worker) or colocated (prefilled on the decode worker itself)."))
    retries: Counter = field(default_factory=lambda: Counter(
        "mooncake_retries_total", "Requests moved to another worker after a failure, by stage."))
    prompt_tokens: Counter = field(default_factory=lambda: Counter(
        "mooncake_prompt_tokens_total", "Prompt tokens received (tokens)."))
    cached_prompt_tokens: Counter = field(default_factory=lambda: Counter(
        "mooncake_cached_prompt_tokens_total", "Prompt tokens served from a prefix cache (tokens)."))
    generated_tokens: Counter = field(default_factory=lambda: Counter(
        "mooncake_generated_tokens_total", "Tokens generated (tokens)."))
    ttft: Histogram = field(default_factory=lambda: Histogram(
        "mooncake_time_to_first_token_seconds", "Arrival to first token (seconds).", _LATENCY_S))
    tbt: Histogram = field(default_factory=lambda: Histogram(
        "mooncake_time_between_tokens_seconds", "Gap between streamed token chunks (seconds).", _TBT_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(
        "mooncake_request_latency_seconds", "Arrival to last token (seconds).", _LATENCY_S))
    ttft_prediction: Histogram = field(default_factory=lambda: Histogram(
        "mooncake_ttft_prediction_ratio", "Measured TTFT / the scheduler's predicted TTFT (ratio; above 1: "
        "the profile table is optimistic for this hardware, and SLO admission lets through requests "
        "that will miss).", _RATIO))

    def render(self, in_flight: int, ready_workers: dict[str, int],
               push_bandwidth_Bps: dict[str, float] | None = None) -> str:
        lines: list[str] = []
        for inst in (self.requests, self.rejections, self.routes, self.retries, self.prompt_tokens,
                     self.cached_prompt_tokens, self.generated_tokens, self.ttft, self.tbt, self.e2e,
                     self.ttft_prediction):
            lines += inst.render()
        lines += gauge("mooncake_in_flight_requests", "Requests in progress.", in_flight)
        lines += gauge_family("mooncake_ready_workers", "Workers whose engine is ready, by role.", "role",
                              ready_workers)
        lines += gauge_family("mooncake_kv_push_bandwidth_bytes_per_second",
                              "Measured KV push bandwidth of each prefill worker, as the scheduler prices "
                              "transfers with it (bytes per second).", "instance", push_bandwidth_Bps or {})
        return "\n".join(lines) + "\n"
