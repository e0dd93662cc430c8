"""The conductor's own metrics: what users saw (status codes, TTFT, TBT, end-to-end latency),
whether each request met its SLO (goodput), and how long scheduling took.

Each app builds its own ConductorMetrics, with its own CollectorRegistry: nothing is registered
in prometheus_client's process-wide default registry, so two conductors in one process (tests)
never share a count. Gauges that describe the present (requests in flight, ready workers,
measured push bandwidth) are read from the live state when scraped, never pushed per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from conductor.core.types import RejectReason
from mooncake import defaults
from mooncake.prometheus_text import WithoutCreated

_LATENCY_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_TBT_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0)
_RATIO = (0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_SCHEDULE_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

SLO_OUTCOMES = ("met", "missed_ttft", "missed_tbt", "failed", "refused", "cancelled")
"""How a request ended, judged against its SLO (mooncake_slo_requests_total's `outcome`):
met: answered in full with TTFT and mean TBT within the SLO (this is goodput); missed_ttft: the
first token came too late; missed_tbt: it did not, but the mean gap between tokens was too long;
failed: an error answer after admission (a worker failed); refused: 429/503 before any work
(admission, no capacity, no worker); cancelled: the client left before the end (not judged:
attainment leaves it out)."""
# mooncake_rejections_total's `reason`: the scheduler's, and the conductor's own in-flight cap
# (conductor/serving.py).
REJECT_REASONS = (*(str(r) for r in RejectReason), "max_in_flight")


CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass
class LiveState:
    """What the scrape-time gauges show, read from the app's state at each scrape."""
    in_flight: int = 0
    ready_workers: dict[str, int] = field(default_factory=dict)  # by role
    can_serve: bool = False
    """Some ready worker can decode (conductor.workers.can_serve): else every request gets 503."""
    push_bandwidth_Bps: dict[str, float] = field(default_factory=dict)  # by instance (measured ones only)
    estimators: dict[str, dict[str, Any]] = field(default_factory=dict)
    """By instance: Calibration.describe() (conductor/core/calibration.py)."""
    retry_backlog_s: dict[str, float] = field(default_factory=dict)
    """By resource: how far ahead the Retry-After given to refused requests has it booked
    (RetryBook.backlog_s)."""


class _LiveCollector:
    def __init__(self, read: Callable[[], LiveState]):
        self._read = read

    def collect(self):
        state = self._read()
        yield GaugeMetricFamily("mooncake_in_flight_requests", "Requests in progress.", value=state.in_flight)
        ready = GaugeMetricFamily("mooncake_ready_workers", "Workers whose engine is ready, by role.",
                                  labels=["role"])
        for role, n in sorted(state.ready_workers.items()):
            ready.add_metric([role], n)
        yield ready
        yield GaugeMetricFamily(
            "mooncake_serving_ready", "1 when some ready worker can decode a request (any ready worker with "
            "flexible roles, a decode worker with fixed roles), else 0: every request gets 503.",
            value=int(state.can_serve))
        bandwidth = GaugeMetricFamily(
            "mooncake_kv_push_bandwidth_bytes_per_second",
            "Measured KV push bandwidth of each prefill worker, as the scheduler prices transfers with it "
            "(bytes per second).", labels=["instance"])
        for instance, bps in sorted(state.push_bandwidth_Bps.items()):
            bandwidth.add_metric([instance], bps)
        yield bandwidth
        backlog = GaugeMetricFamily(
            "mooncake_retry_backlog_seconds",
            "How far ahead the requests refused with a Retry-After are told to come back, by the resource they "
            "wait for (prefill or decode; seconds).", labels=["resource"])
        for resource, seconds in sorted(state.retry_backlog_s.items()):
            backlog.add_metric([resource], seconds)
        yield backlog
        yield from _estimator_gauges(state.estimators)


def _estimator_gauges(estimators: dict[str, dict[str, Any]]):
    """Each instance's calibrated estimators (conductor/core/calibration.py)."""
    families = {
        ("prefill", "scale"): GaugeMetricFamily(
            "mooncake_estimator_prefill_scale", "Measured prefill time / the profile's prediction, as fitted "
            "for each instance and used to price it (ratio; 1: the profile is right).", labels=["instance"]),
        ("decode_step", "scale"): GaugeMetricFamily(
            "mooncake_estimator_decode_step_scale", "Measured decode step time / the profile's prediction, as "
            "fitted for each instance and used to price it (ratio).", labels=["instance"]),
        ("ttft_residual", "scale"): GaugeMetricFamily(
            "mooncake_estimator_ttft_residual", "Measured TTFT / the TTFT predicted when the request was "
            "routed, as fitted for each prefill instance; its prefill price is multiplied by it (ratio; 1: "
            "the queue and prefill model are right under the load the cluster runs at).", labels=["instance"]),
        ("prefill", "relative_error"): GaugeMetricFamily(
            "mooncake_estimator_prefill_relative_error", "Median |measured - calibrated prediction| / measured "
            "prefill time over the recent samples (ratio).", labels=["instance"]),
        ("decode_step", "relative_error"): GaugeMetricFamily(
            "mooncake_estimator_decode_step_relative_error", "Median |measured - calibrated prediction| / "
            "measured decode step time over the recent samples (ratio).", labels=["instance"]),
    }
    samples = GaugeMetricFamily("mooncake_estimator_samples", "Measurements each instance's calibration has "
                                "seen, by kind (prefill, decode_step, ttft_residual).",
                                labels=["instance", "kind"])
    for instance, fits in sorted(estimators.items()):
        for (kind, key), family in families.items():
            value = fits[kind][key]
            if value is not None:  # no error before the first sample
                family.add_metric([instance], value)
        for kind in ("prefill", "decode_step", "ttft_residual"):
            samples.add_metric([instance, kind], fits[kind]["samples"])
    yield from families.values()
    yield samples


class ConductorMetrics:
    def __init__(self) -> None:
        # prometheus_client appends `_total` to a counter's name: "mooncake_requests" is exposed
        # as mooncake_requests_total.
        self.registry = r = CollectorRegistry()
        # slo_class: the request's SLO class (conductor/slo.py): `default`, an operator's class, or
        # `unknown` for a request refused for naming none of them.
        self.requests = Counter("mooncake_requests", "Requests answered, by endpoint, HTTP status and SLO class.",
                                ["endpoint", "status", "slo_class"], registry=r)
        self.rejections = Counter("mooncake_rejections", "Requests refused before any work, by reason and SLO class.",
                                  ["reason", "slo_class"], registry=r)
        self.best_effort = Counter(
            "mooncake_best_effort_admissions", "Requests admitted best effort: their own prefill misses the TTFT "
            "SLO even on an idle cluster, and no worker that may prefill had anything queued.",
            ["slo_class"], registry=r)
        self.routes = Counter(
            "mooncake_routes", "Requests routed, by kind: disaggregated (prefill worker, then decode worker) "
            "colocated (prefilled on the decode worker itself) or flexible (a pair that breaks a worker's role label: "
            "flexible roles).", ["kind"], registry=r)
        self.prefix_fetches = Counter(
            "mooncake_prefix_fetches", "Routes whose prefill worker pulls a prefix from another worker's KVCache "
            "pool (Algorithm 1's fetch_from) instead of computing it.", registry=r)
        self.prefix_fetch_tokens = Counter(
            "mooncake_prefix_fetch_tokens", "Prompt tokens those routes pull from another worker's pool (tokens).",
            registry=r)
        self.retries = Counter("mooncake_retries", "Requests moved to another worker after a failure, by stage.",
                               ["stage"], registry=r)
        self.streams_given_up = Counter(
            "mooncake_worker_streams_given_up", "Request streams from a worker that stopped answering /health "
            "(frozen, or its host gone), ended without waiting token_timeout_s, by instance.", ["instance"], registry=r)
        self.prompt_tokens = Counter("mooncake_prompt_tokens", "Prompt tokens received (tokens).", registry=r)
        self.cached_prompt_tokens = Counter("mooncake_cached_prompt_tokens",
                                            "Prompt tokens served from a prefix cache (tokens).", registry=r)
        self.generated_tokens = Counter("mooncake_generated_tokens", "Tokens generated (tokens).", registry=r)
        self.ttft = Histogram("mooncake_time_to_first_token_seconds", "Arrival to first token, by SLO class "
                              "(seconds).", ["slo_class"], buckets=_LATENCY_S, registry=r)
        self.tbt = Histogram("mooncake_time_between_tokens_seconds",
                             "Gap between streamed token chunks, by SLO class (seconds).", ["slo_class"],
                             buckets=_TBT_S, registry=r)
        self.e2e = Histogram("mooncake_request_latency_seconds", "Arrival to last token, by SLO class (seconds).",
                             ["slo_class"], buckets=_LATENCY_S, registry=r)
        self.ttft_prediction = Histogram(
            "mooncake_ttft_prediction_ratio", "Measured TTFT / the scheduler's predicted TTFT (ratio; above 1: "
            "the profile table is optimistic for this hardware, and SLO admission lets through requests "
            "that will miss).", buckets=_RATIO, registry=r)

        self.slo_requests = Counter(
            "mooncake_slo_requests", "Requests by SLO class and outcome: met, missed_ttft, missed_tbt, failed, "
            "refused, cancelled (conductor/metrics.py SLO_OUTCOMES says what each means).",
            ["slo_class", "outcome"], registry=r)
        self.goodput = Counter(
            "mooncake_goodput_requests", "Requests answered in full with TTFT and mean TBT within their SLO, by "
            "SLO class; rate() is goodput in requests per second.", ["slo_class"], registry=r)
        self.schedule = Histogram(
            "mooncake_schedule_seconds", "Time to choose a request's route: hash its blocks, snapshot the cluster, "
            "ask the scheduling core; refusals included (seconds).", buckets=_SCHEDULE_S, registry=r)
        # The default class's series are present from the first scrape, at zero: a rate over a series that appears only with its
        # first event misses that event, and alerts on a ratio see no data instead of zero.
        for outcome in SLO_OUTCOMES:
            self.slo_requests.labels(slo_class=defaults.DEFAULT_SLO_CLASS, outcome=outcome)
        self.goodput.labels(slo_class=defaults.DEFAULT_SLO_CLASS)
        for reason in REJECT_REASONS:
            self.rejections.labels(reason=reason, slo_class=defaults.DEFAULT_SLO_CLASS)

    def count_slo(self, slo_class: str, outcome: str) -> None:
        """One request's SLO outcome (one of SLO_OUTCOMES); a met one is goodput too."""
        self.slo_requests.labels(slo_class=slo_class, outcome=outcome).inc()
        if outcome == "met":
            self.goodput.labels(slo_class=slo_class).inc()

    def watch(self, read: Callable[[], LiveState]) -> None:
        """Serve the scrape-time gauges from `read` (called once per scrape). Call once per app."""
        self.registry.register(_LiveCollector(read))

    def render(self) -> bytes:
        """The Prometheus text exposition (CONTENT_TYPE)."""
        return generate_latest(WithoutCreated(self.registry))

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value by its exposed name (0 when never set); for tests and tools."""
        return self.registry.get_sample_value(name, labels) or 0.0


def slo_outcome(status: str | None, ttft_s: float | None, mean_tbt_s: float | None, ttft_slo_s: float,
                tbt_slo_s: float) -> str:
    """How an admitted request ended, against its SLO (SLO_OUTCOMES). `status` is the HTTP
    status answered (None: the client left first); `mean_tbt_s` is None with fewer than two
    tokens, which has no gap to judge."""
    if status is None:
        return "cancelled"
    if status != "200" or ttft_s is None:
        return "failed"
    if ttft_s > ttft_slo_s:
        return "missed_ttft"
    if mean_tbt_s is not None and mean_tbt_s > tbt_slo_s:
        return "missed_tbt"
    return "met"


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
"""The paths counted in mooncake_requests_total, by their endpoint label."""


class RefusalCounter:
    """ASGI middleware: counts in mooncake_requests_total the answers of the completion endpoints
    that never reached the app's handler, which counts every other answer itself (the handler
    marks the request state `served`): an API key refused (401), a body over the limit (413)
    or one that fails validation (400). The SLO class label is read from the header, as for
    any request refused before its SLO is resolved."""

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the FastAPI app's state: its metrics, and its service once started

    async def __call__(self, scope, receive, send):
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start" and not scope.get("state", {}).get("served"):
                from starlette.datastructures import Headers

                service = getattr(self.state, "service", None)
                slo_class = (service.slo_policy.label(Headers(scope=scope)) if service is not None
                             else defaults.DEFAULT_SLO_CLASS)
                self.state.metrics.requests.labels(endpoint=endpoint, status=str(message["status"]),
                                                   slo_class=slo_class).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
