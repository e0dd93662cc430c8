"""The conductor's /metrics text, rendered by prometheus_client from the app's own registry."""

from prometheus_client.parser import text_string_to_metric_families

from conductor.metrics import ConductorMetrics, LiveState


def test_label_values_are_escaped_and_parse_back_to_the_original():
    odd = 'w"1\\\nx'  # a double quote, a backslash and a newline
    metrics = ConductorMetrics()
    metrics.rejections.labels(reason=odd, slo_class="default").inc()
    metrics.watch(lambda: LiveState(in_flight=0, ready_workers={}, push_bandwidth_Bps={odd: 2e9}))
    text = metrics.render().decode()
    assert odd not in text  # the raw newline would end the sample line
    families = {f.name: f for f in text_string_to_metric_families(text)}
    bandwidth = families["mooncake_kv_push_bandwidth_bytes_per_second"].samples
    assert [(s.labels["instance"], s.value) for s in bandwidth] == [(odd, 2e9)]
    rejections = [s for s in families["mooncake_rejections"].samples if s.name == "mooncake_rejections_total"]
    assert [(s.labels["reason"], s.value) for s in rejections if s.value] == [(odd, 1.0)]


def test_each_app_counts_alone_and_scrape_time_gauges_read_live_state():
    state = LiveState(in_flight=3, ready_workers={"decode": 1})
    a, b = ConductorMetrics(), ConductorMetrics()
    a.watch(lambda: state)
    a.routes.labels(kind="colocated").inc()
    assert a.value("mooncake_routes_total", kind="colocated") == 1
    assert b.value("mooncake_routes_total", kind="colocated") == 0
    assert a.value("mooncake_in_flight_requests") == 3
    state.in_flight = 0  # read at scrape time, not pushed
    assert "mooncake_in_flight_requests 0.0" in a.render().decode()


def test_the_retry_backlog_is_a_gauge_by_resource_in_seconds():
    metrics = ConductorMetrics()
    metrics.watch(lambda: LiveState(retry_backlog_s={"prefill": 7.5, "decode": 0.0}))
    assert metrics.value("mooncake_retry_backlog_seconds", resource="prefill") == 7.5
    assert metrics.value("mooncake_retry_backlog_seconds", resource="decode") == 0.0


def test_serving_ready_follows_whether_some_ready_worker_can_decode():
    from conductor.workers import WorkerPool, can_serve

    pool = WorkerPool()
    prefill = pool.add("http://p")
    prefill.role, prefill.ready = "prefill", True
    decode = pool.add("http://d")
    decode.role, decode.ready = "decode", False
    assert can_serve(pool, flexible_roles=True) and not can_serve(pool, flexible_roles=False)
    decode.ready = True
    assert can_serve(pool, flexible_roles=False)
    metrics = ConductorMetrics()
    metrics.watch(lambda: LiveState(can_serve=False))
    assert metrics.value("mooncake_serving_ready") == 0
