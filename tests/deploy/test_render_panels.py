"""deploy/grafana/render_panels.py draws every dashboard panel from Prometheus' query_range
answers. Here Prometheus is a stand-in transport that answers each query with one series (the
real Prometheus drew docs/img/dashboard.png: benchmarks/dashboard_run.sh)."""

import importlib.util
import json
from urllib.parse import parse_qs

import httpx

from tests.deploy.promql import DASHBOARD, DEPLOY


def load_renderer():
    spec = importlib.util.spec_from_file_location("render_panels", DEPLOY / "grafana" / "render_panels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_panel_is_drawn_from_its_own_queries(tmp_path):
    render_panels = load_renderer()
    asked: list[str] = []

    def prometheus(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/v1/query_range"
        params = parse_qs(request.url.query.decode())
        asked.append(params["query"][0])
        start, end = float(params["start"][0]), float(params["end"][0])
        values = [[start + i * 60, str(0.5 + i % 2)] for i in range(int((end - start) // 60))] + [[end, "NaN"]]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"instance": "w:8100", "role": "prefill", "source": "local_cache_hit"}, "values": values}]}})

    out = tmp_path / "dashboard.png"
    drawn = render_panels.render("http://prometheus", DASHBOARD, 0.0, 600.0, "1m", out,
                                 transport=httpx.MockTransport(prometheus))
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert drawn == len(panels)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    expected = [t["expr"].replace("$__rate_interval", "1m") for p in panels for t in p["targets"]]
    assert asked == expected  # each target once, in order, with Grafana's variable replaced


def test_legend_format_takes_the_series_labels():
    render_panels = load_renderer()
    assert render_panels.legend("{{role}} {{instance}} running", {"role": "decode", "instance": "w:8101"}) == \
        "decode w:8101 running"
    assert render_panels.legend("", {"__name__": "up", "job": "x"}) == '{job="x"}'
