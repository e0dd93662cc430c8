"""goodput.py's reading of our conductor's route counters (the systems it starts run only there)."""

from benchmarks.goodput import routes_from_metrics


def test_routes_by_kind_are_read_from_the_conductors_metrics():
    text = "\n".join([
        "# HELP mooncake_routes_total Requests routed, by kind",
        "# TYPE mooncake_routes_total counter",
        'mooncake_routes_total{kind="disaggregated"} 97.0',
        'mooncake_routes_total{kind="flexible"} 31.0',
        'mooncake_routes_created{kind="flexible"} 1.7e9',
        'mooncake_requests_total{status="ok"} 140.0',
    ])
    assert routes_from_metrics(text) == {"disaggregated": 97.0, "flexible": 31.0}
    assert routes_from_metrics("") == {}
