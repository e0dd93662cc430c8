"""benchmarks/store_bench.py: its quick mode on our side runs and checks what it moves."""

from __future__ import annotations

import subprocess
import sys

from benchmarks import store_bench
from tests.processes import ROOT


def test_help():
    out = subprocess.run([sys.executable, "-m", "benchmarks.store_bench", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--quick" in out.stdout and "Mooncake Store" in out.stdout


def test_quick_mode_of_our_side(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.store_bench", "--quick", "--no-peer", "--no-index",
                          "--sizes", "64K", "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| get (remote, tcp) |" in out.stdout and "| put (local) |" in out.stdout
    import json

    figures = json.loads((tmp_path / "r.json").read_text())["sizes"][str(64 << 10)]["ours"]
    for key in ("put", "get", "batch_get", "remote_get", "remote_batch_get", "remote_get_arena"):
        assert figures[key]["ops_per_s"] > 0 and figures[key]["ops"] == 64
    assert figures["remote_checked"] > 0 and figures["remote_checked_arena"] > 0
    assert figures["remote_get_arena"]["transport"] == "its arena"


def test_report_states_each_goal():
    row = {"ops_per_s": 100.0, "gb_per_s": 1.0, "ops": 10, "seconds": 0.1}
    ours = {k: dict(row) for k in ("put", "get", "batch_get")}
    ours.update({k: {**row, "ops_per_s": 300.0, "transport": t} for k, t in
                 (("remote_get", "tcp"), ("remote_batch_get", "tcp"), ("remote_get_auto", "shm"),
                  ("remote_batch_get_auto", "shm"), ("remote_get_arena", "its arena"),
                  ("remote_batch_get_arena", "its arena"))})
    theirs = {k: dict(row) for k in ("put", "get", "batch_get", "remote_put", "remote_get", "remote_batch_get")}
    text = store_bench.report({"sizes": {str(64 << 10): {"ours": ours, "mooncake_store": theirs}}})
    assert "Goal remote get >= 2.0x Mooncake Store, ours over tcp: 3.00x (met)" in text
    assert "| get (remote, same host: shm) | 300 |" in text
    assert "| get (remote, same host: its arena) | 300 |" in text
    assert "Goal remote batch get >= 2.0x Mooncake Store, ours over its arena: 3.00x (met)" in text
    assert "| put (remote) | n/a | n/a | 100 |" in text


def test_ssd_comparison_of_our_side(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.kv_offload.tiering.fs.io", None)  # importing vLLM takes seconds
    figures = store_bench.ssd_comparison(64 << 10, 8, str(tmp_path))
    assert figures["ours_write"]["ops"] == 8 and figures["ours_read"]["gb_per_s"] > 0
    assert "vllm_error" in figures
    assert list(tmp_path.iterdir()) == []  # its files are gone
