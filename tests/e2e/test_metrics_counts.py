"""/metrics after known traffic on the real cluster: the conductor's and the workers' counters
move by exactly what was sent, and everything the dashboard and the rules query is exported.

The cluster is shared by the session and tests run in random order, so every check is a delta
between a scrape before and a scrape after this test's own requests."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL_NAME
from tests.deploy.promql import (PROMETHEUS_OWN, dashboard_queries, exported_names, metric_names,
                                 recording_rule_names, rules)

pytestmark = pytest.mark.vllm

PROMPTS = ["The capital of France is", "One, two, three, four,", "Water boils at a temperature of"]


class Scrape:
    """One /metrics text, read as {(sample name, sorted labels): value}."""

    def __init__(self, url: str):
        self.text = httpx.get(url + "/metrics", timeout=30).text
        self.samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                        for f in text_string_to_metric_families(self.text) for s in f.samples}

    def sum(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels`."""
        return sum(v for (n, ls), v in self.samples.items() if n == name and set(labels.items()) <= set(ls))


def workers(cluster) -> dict[str, Scrape]:
    return {role: Scrape(url) for role, url in cluster.worker_urls.items()}


SETTLING = ("mooncake_worker_prompt_tokens_total", "mooncake_worker_prefill_tokens_total",
            "mooncake_worker_cached_prompt_tokens_total", "mooncake_worker_decode_tokens_total",
            "mooncake_worker_requests_total")


def settled_workers(cluster, within_s: float = 30.0) -> dict[str, Scrape]:
    """The workers' scrapes once no request is left on them: a request an earlier test ended early
    (a stop string, a client that left) is aborted after its answer, and counted when the abort
    lands, which would fall into this test's deltas."""
    deadline = time.monotonic() + within_s
    last = workers(cluster)
    while True:
        time.sleep(0.5)
        now = workers(cluster)
        idle = all(s.sum("mooncake_worker_engine_running_requests") == 0 for s in now.values())
        if idle and all(now[r].sum(n) == last[r].sum(n) for r in now for n in SETTLING):
            return now
        assert time.monotonic() < deadline, "the workers' counters never settled"
        last = now


def eventually(check: Callable[[], None], within_s: float = 15.0) -> None:
    """A worker counts a request's prompt tokens when its response stream closes, a moment after
    the conductor has the last token: retry a check that reads them for a few seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_counts_after_three_completions_one_bad_request_and_one_stream(spine_cluster):
    base = spine_cluster.base_url
    workers_before = settled_workers(spine_cluster)
    before = Scrape(base)
    client = openai.OpenAI(base_url=spine_cluster.api, api_key="x", max_retries=0, timeout=120)
    usages = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0).usage
              for p in PROMPTS]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=100_000)
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 4
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    completion_tokens = sum(u.completion_tokens for u in usages)
    cached_tokens = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    after = Scrape(base)

    def delta(name: str, **labels: str) -> float:
        return after.sum(name, **labels) - before.sum(name, **labels)

    # The conductor: answers by status, SLO outcomes, latency histograms, tokens.
    assert delta("mooncake_requests_total", endpoint="completions", status="200") == 4
    assert delta("mooncake_requests_total", endpoint="completions", status="400") == 1
    judged = {o: delta("mooncake_slo_requests_total", slo_class="default", outcome=o)
              for o in ("met", "missed_ttft", "missed_tbt", "failed", "refused", "cancelled")}
    assert judged["met"] + judged["missed_ttft"] + judged["missed_tbt"] == 4, judged  # the 400 is not judged
    assert judged["failed"] == judged["refused"] == judged["cancelled"] == 0, judged
    assert delta("mooncake_goodput_requests_total", slo_class="default") == judged["met"]
    for histogram in ("mooncake_schedule_seconds", "mooncake_time_to_first_token_seconds",
                      "mooncake_request_latency_seconds"):
        assert delta(histogram + "_count") == 4, histogram  # the 400 was refused before scheduling
    assert delta("mooncake_ttft_prediction_ratio_count") == 4
    assert delta("mooncake_routes_total") == 4
    assert delta("mooncake_prompt_tokens_total") == prompt_tokens
    assert delta("mooncake_cached_prompt_tokens_total") == cached_tokens
    assert delta("mooncake_generated_tokens_total") == completion_tokens

    # The workers: what the engines computed, found cached, received and generated.
    def engines_count_what_the_shells_received():
        now = workers(spine_cluster)

        def worker_delta(name: str, **labels: str) -> float:
            return sum(now[r].sum(name, **labels) - workers_before[r].sum(name, **labels) for r in now)

        # Each engine prefilled every prompt token it was sent, or found it cached, or loaded it.
        engine_prompt = worker_delta("mooncake_worker_prefill_tokens_total") + worker_delta(
            "mooncake_worker_cached_prompt_tokens_total")
        assert engine_prompt == worker_delta("mooncake_worker_prompt_tokens_total") >= prompt_tokens
        # P generates the first token, D the rest (or one worker all of them): together, the answer.
        assert worker_delta("mooncake_worker_decode_tokens_total") == completion_tokens
        assert worker_delta("mooncake_worker_requests_total", outcome="ok") >= 4

    eventually(engines_count_what_the_shells_received)
    for scrape in workers(spine_cluster).values():
        assert 0 <= scrape.sum("mooncake_worker_kv_cache_usage_ratio") <= 1
        assert scrape.sum("mooncake_worker_engine_running_requests") >= 0
        assert ("mooncake_messenger_bytes_total", (("direction", "sent"), ("transport", "tcp"))) in scrape.samples


def test_a_pushed_prompt_moves_the_same_bytes_out_of_p_and_into_d(disaggregated_api, spine_cluster):
    """Through the fixed-roles conductor, so the KV is pushed: P's messenger sends exactly the
    frames D's receives, and D's engine reports the prompt as loaded from the transfer."""
    before = settled_workers(spine_cluster)
    client = openai.OpenAI(base_url=disaggregated_api, api_key="x", max_retries=0, timeout=120)
    # ~600 tokens: several blocks to push. The nonce first: no other test's prompt shares a block.
    words = f"{secrets.token_hex(8)} " + " ".join(f"item{i}" for i in range(150))
    response = client.completions.with_raw_response.create(model=MODEL_NAME, prompt=words, max_tokens=3,
                                                            temperature=0)
    assert response.headers["x-mooncake-prefill"] != response.headers["x-mooncake-decode"]

    def transfer_counted():
        after = workers(spine_cluster)

        def delta(role: str, name: str, **labels: str) -> float:
            return after[role].sum(name, **labels) - before[role].sum(name, **labels)

        # The engine picks shm between workers on one host, tcp otherwise (or when forced).
        transport = max(("tcp", "shm"), key=lambda t: delta("prefill", "mooncake_messenger_bytes_total",
                                                            transport=t, direction="sent"))
        sent = delta("prefill", "mooncake_messenger_bytes_total", transport=transport, direction="sent")
        assert sent == delta("decode", "mooncake_messenger_bytes_total", transport=transport, direction="received")
        pushed = delta("prefill", "mooncake_kv_pushed_bytes_total")
        replies = delta("prefill", "mooncake_messenger_bytes_total", transport=transport, direction="received")
        assert replies == delta("decode", "mooncake_messenger_bytes_total", transport=transport, direction="sent")
        if transport == "tcp":
            assert sent > pushed > 0 and replies > 0  # frames: KV plus prefix and header; acks and replies
        else:
            assert sent == pushed > 0  # shm counts the bytes copied, nothing else
        assert delta("prefill", "mooncake_messenger_request_seconds_count", transport=transport) >= 1
        assert delta("decode", "mooncake_worker_cached_prompt_tokens_total", source="external_kv_transfer") > 0

    eventually(transfer_counted)


def test_everything_the_dashboard_and_the_rules_query_is_in_a_real_scrape(spine_cluster):
    scraped = exported_names(Scrape(spine_cluster.base_url).text)
    for scrape in workers(spine_cluster).values():
        scraped |= exported_names(scrape.text)
    known = scraped | recording_rule_names() | PROMETHEUS_OWN
    queried = set().union(*(metric_names(expr) for _, expr in dashboard_queries()),
                          *(metric_names(rule["expr"]) for rule in rules()))
    assert queried <= known, sorted(queried - known)
