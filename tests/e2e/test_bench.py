"""`mooncake bench` against the real embedded cluster (its Python entry, not a subprocess)."""

import json

import pytest

from mooncake.bench.cli import main
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.vllm


def test_bench_measures_the_spine_cluster(spine_cluster, tmp_path):
    out = tmp_path / "bench.json"
    rc = main(["--url", spine_cluster.api, "--model", MODEL_NAME, "--num-requests", "4", "--input-len", "180-220",
               "--output-len", "8", "--rate", "20", "--ttft-slo", "30", "--tbt-slo", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    s, reqs = run["summary"], run["requests"]
    assert (s["requests"], s["completed"], s["refused"], s["errors"]) == (4, 4, 0, 0), reqs
    for r in reqs:
        assert r["tokens"] == 8 and 180 <= r["input_length"] <= 220  # ignore_eos: exact lengths
        assert 0 < r["ttft_s"] < 30 and 0 < r["mean_tbt_s"] < 2 and r["e2e_s"] > r["ttft_s"]
        assert len(r["chunk_s"]) >= 2
    assert 0 <= s["attainment"] <= 1 and s["duration_s"] > 0
    assert s["goodput"] == pytest.approx(min(s["attainment"] * 20, s["attainment"] * 4 / s["duration_s"]))
    assert doc["slo_capacity"] in (None, 20)
    # Our conductor says what it predicted; bench reports how measured TTFT compares with it.
    assert all(r["predicted_ttft_s"] > 0 for r in reqs)
    ratio = s["ttft_over_predicted"]
    assert ratio["n"] == 4 and ratio["p10"] <= ratio["p50"] <= ratio["p90"]
    ratios = sorted(r["ttft_s"] / r["predicted_ttft_s"] for r in reqs)
    assert ratio["p50"] == pytest.approx((ratios[1] + ratios[2]) / 2)
