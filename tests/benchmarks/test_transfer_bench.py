"""benchmarks/transfer_bench.py's own part (limits and our engine) in its quick mode, so the script
cannot rot: real worker processes, real sockets, every byte checked. No peer venvs are built."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from benchmarks import transfer_bench
from benchmarks.transfer import common
from benchmarks.transfer.report import Case, Goal, ratio_lines, ratios, summarize, table
from benchmarks.transfer.runner import WorkerFailed, WorkerSpec, run_pair


def test_quick_run_of_limits_and_ours(tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = transfer_bench.main(["--quick", "--only", "limits,ours", "--sizes", "1", "--json", str(out),
                                  "--plot", ""])
    assert status == 0
    result = json.loads(out.read_text())
    measured = {r["case"] for r in result["rows"]}
    # The limits and our tcp and shm transports always run here; nixl only where installed.
    assert {"limit memcpy", "limit raw tcp x1", "limit raw tcp x4", "ours tcp", "ours shm"} <= measured
    for case in ("ours nixl/tcp", "ours nixl/shm"):
        assert case in measured or result["unavailable"][case]
    for row in result["rows"]:
        assert row["verified"] is True, row
        assert len(row["gbps"]) == 2 and row["min"] > 0
    assert {(r["op"], r["slice_bytes"]) for r in result["rows"] if r["case"] == "ours tcp"} == {
        ("read", common.MiB), ("write", common.MiB)}
    shm_vs_copy = [e for e in result["ratios"] if e["goal"] == "ours shm / memory copy"]
    assert shm_vs_copy and all(e["ratio"] > 0 for e in shm_vs_copy)
    printed = capsys.readouterr().out
    assert "| ours | tcp |" in printed and "QUICK" in printed


def test_patterns_catch_a_slice_at_the_wrong_offset():
    plan = common.Plan((common.MiB,), 2, inflight=2, round_bytes=4 * common.MiB, rounds=1)
    region = common.new_region(plan, None)
    common.fill(region, plan.write_seed(common.MiB))
    assert common.writes_landed(plan, region)
    region[common.MiB:2 * common.MiB] = region[:common.MiB].copy()  # slice 0's bytes where slice 1 goes
    assert not common.writes_landed(plan, region)


def test_table_and_ratios_say_what_was_not_measured():
    ours, peer = Case("ours", "tcp", "tcp"), Case("Mooncake TE", "tcp", "tcp")
    rows = [summarize(ours, {"op": "write", "slice_bytes": common.MiB, "gbps": [3.0, 4.0, 5.0], "verified": True}),
            summarize(peer, {"op": "write", "slice_bytes": common.MiB, "gbps": [2.0], "verified": True})]
    entries = ratios([Goal("ours tcp / Mooncake TE tcp", ("ours tcp",), ("Mooncake TE tcp",), 2.0)], rows)
    assert entries[0]["ratio"] == pytest.approx(2.0) and entries[0]["met"]
    text = table([ours, peer, Case("NIXL", "tcp", "tcp")], rows, {"NIXL tcp": "venv not built"})
    assert "4.00 (3.00-5.00)" in text and "not available: venv not built" in text
    assert np.isclose(rows[0]["median"], 4.0)


def test_a_worker_that_cannot_run_or_dies_is_reported_not_awaited():
    plan = common.Plan((common.MiB,), 1, inflight=1, round_bytes=common.MiB, rounds=1)
    says_unavailable = WorkerSpec([sys.executable, "-c", 'print(\'{"unavailable": "no such device"}\')'])
    with pytest.raises(WorkerFailed, match="no such device") as caught:
        run_pair(says_unavailable, plan, "x", timeout_s=30)
    assert caught.value.unavailable
    dies = WorkerSpec([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    with pytest.raises(WorkerFailed, match="boom") as caught:
        run_pair(dies, plan, "x", timeout_s=30)
    assert not caught.value.unavailable


def test_a_goal_above_the_wires_own_limit_is_named_so():
    ours, peer, raw = Case("ours", "tcp", "tcp"), Case("Mooncake TE", "tcp", "tcp"), Case("limit", "raw tcp x4", "tcp")
    size = common.MiB

    def rows(raw_gbps):
        return [summarize(ours, {"op": "write", "slice_bytes": size, "gbps": [2.5], "verified": True}),
                summarize(peer, {"op": "write", "slice_bytes": size, "gbps": [3.0], "verified": True}),
                summarize(raw, {"op": "write", "slice_bytes": size, "gbps": raw_gbps, "verified": None})]

    goal = Goal("ours tcp / Mooncake TE tcp", ("ours tcp",), ("Mooncake TE tcp",), 2.0, wire="tcp")
    beyond = ratios([goal], rows([4.0, 5.5, 4.5]))[0]
    assert beyond["beyond_limit"] and beyond["needed_gbps"] == pytest.approx(6.0) and beyond["limit_gbps"] == 5.5
    assert "needs 6.00 GB/s, above any round on this wire, 5.50" in ratio_lines([beyond])
    # One round of the raw socket above 2x the peer: the goal was within the wire's reach.
    within = ratios([goal], rows([4.0, 6.5]))[0]
    assert not within["beyond_limit"] and "needs" not in ratio_lines([within])
