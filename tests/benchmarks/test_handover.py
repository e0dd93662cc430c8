"""The pure parts of benchmarks/handover.py: the Figure-5 arithmetic on synthetic layer
timelines, the options, the TTFT table and the plot (no engine is started)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import handover
from benchmarks.handover_plot import draw
from benchmarks.kv_overlap import by_length, overlap, overlaps, summarize, timeline_of


def test_exposed_is_wire_time_after_the_last_compute():
    # Layers computed at 1, 2, 3, 4 s; layer 2's push is slow and delays layer 3's.
    t = overlap([(1, 1.5), (2, 2.5), (3, 4.5), (4, 5.0)], "t", 2048)
    assert t.wire == pytest.approx((0.5, 0.5, 1.5, 0.5))
    assert t.exposed == pytest.approx((0, 0, 0.5, 0.5))
    assert t.hidden == pytest.approx((0.5, 0.5, 1.0, 0.0))
    assert t.exposed_s == pytest.approx(1.0)  # = last landing - end of compute
    assert t.hidden_fraction == pytest.approx(2 / 3)


def test_fully_hidden_transfer_has_no_exposed_time():
    t = overlap([(1, 1.2), (2, 2.2), (3, 3.0)])
    assert t.exposed_s == 0 and t.hidden_fraction == 1.0


def test_a_layer_landing_before_an_earlier_one_adds_no_wire_time():
    t = overlap([(1, 3.0), (1.5, 2.0)])
    assert t.wire == pytest.approx((2.0, 0.0))
    assert t.exposed_s == pytest.approx(1.5)


def test_empty_transfer_is_refused():
    with pytest.raises(ValueError, match="no layers"):
        overlap([], "x")


@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=40))
def test_layers_exposed_times_add_up_to_the_exposed_tail(layers):
    t = overlap(layers)
    assert t.exposed_s == pytest.approx(max(0.0, max(t.landed) - t.compute_end), abs=1e-9)
    assert all(0 <= e <= w + 1e-12 for e, w in zip(t.exposed, t.wire))
    assert 0.0 <= t.hidden_fraction <= 1.0 + 1e-12


def test_timeline_is_found_at_the_top_or_in_the_connector_stats_or_is_none():
    entry = {"transfer_id": "a", "num_tokens": 10, "layers": [[1, 2]]}
    assert timeline_of({"layer_timeline": [entry]}) == [entry]
    assert timeline_of({"stats": {"layer_timeline": [entry]}}) == [entry]
    assert timeline_of({"stats": {"pushed_bytes": 1}}) is None


def test_transfers_are_grouped_by_nearest_length_keeping_the_last():
    timeline = [{"transfer_id": str(i), "num_tokens": n, "layers": [[0, 1], [1, 2]]}
                for i, n in enumerate([2048, 2047, 4096, 7168, 7040, 100, 2048])]
    timeline.append({"transfer_id": "empty", "num_tokens": 2048, "layers": []})
    groups = by_length(overlaps(timeline), [2048, 4096, 7168], keep=2)
    assert [t.transfer_id for t in groups[2048]] == ["1", "6"]
    assert [t.transfer_id for t in groups[4096]] == ["2"]
    assert [t.transfer_id for t in groups[7168]] == ["3", "4"]  # 100 tokens fit no length


def test_summary_takes_medians_per_length_and_per_layer():
    ts = [overlap([(1, 1.5), (2, 2 + x)], num_tokens=4096) for x in (0.1, 0.3, 0.5)]
    s = summarize(4096, ts)
    assert (s.transfers, s.layers) == (3, 2)
    assert s.exposed_s == pytest.approx(0.3)
    assert s.exposed_per_layer == pytest.approx((0.0, 0.3))
    assert summarize(4096, []) is None
    mixed = summarize(4096, [ts[0], overlap([(1, 2)], num_tokens=4096)])
    assert mixed.exposed_per_layer == () and mixed.layers == 2


def test_defaults_are_the_issue_run():
    c = handover.parse_args([])
    assert c.lengths == (2048, 4096, 7168) and c.dtype == "bfloat16" and c.reps >= 3
    assert c.cores == (0, 1) and c.goal == 1.03 and c.warmup_each_length
    assert str(c.plot_path) == "docs/img/handover_bfloat16.png"


def test_quick_is_one_short_length_once_and_keeps_docs_untouched():
    c = handover.parse_args(["--quick", "--dtype", "float32"])
    assert c.lengths == (512,) and c.reps == 1 and not c.warmup_each_length
    assert c.dtype == "float32" and "benchmarks/out" in str(c.plot_path)


@pytest.mark.parametrize("argv", [["--dtype", "float16"], ["--cores", "0,0"], ["--cores", "0"],
                                  ["--lengths", "2k"], ["--reps", "0"], ["--output-tokens", "1"]])
def test_bad_options_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        handover.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_names_the_goal(capsys):
    with pytest.raises(SystemExit) as exc:
        handover.parse_args(["--help"])
    assert exc.value.code == 0
    assert "1.03" in capsys.readouterr().out


def test_ttft_table_takes_medians_of_successes():
    c = handover.parse_args(["--lengths", "100,200", "--reps", "3"])
    samples = [{"system": s, "rep": rep, "prompt_tokens": n, "ttft_s": v, "error": None}
               for s, rep, n, v in [("ours", 0, 100, 1.0), ("ours", 1, 100, 3.0), ("ours", 2, 100, 2.0),
                                    ("vllm", 0, 100, 2.0), ("vllm", 1, 100, 2.0), ("vllm", 2, 100, None),
                                    ("ours", 0, 200, 4.0), ("vllm", 0, 200, 5.0)]]
    rows = handover.ttft_table(c, samples)
    assert rows[0]["ours"] == 2.0 and rows[0]["vllm"] == 2.0 and rows[0]["ratio"] == 1.0
    assert rows[0]["vllm_n"] == 2
    assert rows[0]["paired_ratio"] == pytest.approx(1.0)  # turns 0 and 1: 0.5 and 1.5; turn 2 failed
    assert rows[1]["ratio"] == pytest.approx(0.8) and rows[1]["paired_ratio"] == pytest.approx(0.8)


def test_a_length_without_answers_has_no_ratio():
    rows = handover.ttft_table(handover.parse_args(["--lengths", "100"]), [])
    assert math.isnan(rows[0]["ratio"])


def test_push_rate_is_the_difference_of_counters():
    before = {"stats": {"pushed_transfers": 1, "pushed_bytes": 1_000_000, "push_seconds": 0.5}}
    after = {"stats": {"pushed_transfers": 3, "pushed_bytes": 3_000_000_000, "push_seconds": 2.5}}
    moved = handover.push_rate(before, after)
    assert moved["pushed_transfers"] == 2 and moved["gb_per_s"] == pytest.approx(1.4995)
    assert handover.push_rate({}, {})["gb_per_s"] is None


@pytest.mark.parametrize("with_timeline", [True, False])
def test_plot_is_drawn_with_or_without_a_timeline(tmp_path, with_timeline):
    c = handover.parse_args(["--lengths", "2048,4096"])
    rows = [{"prompt_tokens": 2048, "ours": 1.1, "vllm": 1.0, "ratio": 1.1},
            {"prompt_tokens": 4096, "ours": 2.0, "vllm": 2.1, "ratio": 0.95}]
    groups = None
    if with_timeline:
        groups = {n: [overlap([(i * 0.01 * k, i * 0.01 * k + 0.004) for i in range(30)], num_tokens=n)]
                  for k, n in ((1, 2048), (2, 4096))}
    path = tmp_path / "img" / "h.png"
    draw(c, rows, groups, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_first_tokens_are_compared_per_turn():
    samples = [{"system": s, "rep": r, "prompt_tokens": 100, "first_text": t, "error": e}
               for s, r, t, e in [("ours", 0, "a", None), ("vllm", 0, "a", None), ("ours", 1, "b", None),
                                  ("vllm", 1, "c", None), ("ours", 2, "", "boom"), ("vllm", 2, "d", None)]]
    assert handover.same_first_text(samples) == (1, 2)


@pytest.mark.parametrize("with_timeline", [True, False])
def test_report_prints_the_goal_and_the_figure5_table_or_why_not(capsys, with_timeline):
    c = handover.parse_args(["--lengths", "2048,4096", "--reps", "1"])
    samples = [{"system": s, "rep": 0, "prompt_tokens": n, "ttft_s": v, "first_text": "x", "error": None}
               for s, n, v in [("ours", 2048, 1.1), ("vllm", 2048, 1.0), ("ours", 4096, 2.0), ("vllm", 4096, 2.0)]]
    rows = handover.ttft_table(c, samples)
    summaries = None
    if with_timeline:
        summaries = {2048: summarize(2048, [overlap([(1, 1.5), (2, 2.25)], num_tokens=2048)]), 4096: None}
    pushed = handover.push_rate({}, {"stats": {"pushed_transfers": 2, "pushed_bytes": 10**9, "push_seconds": 1.0}})
    handover.report(c, rows, samples, pushed, summaries, {"disaggregated": 4})
    out = capsys.readouterr().out
    assert "| 2,048 | 1.100 s | 1.000 s | 1.100 | MISSED | 1.100 |" in out
    assert "| 4,096 | 2.000 s | 2.000 s | 1.000 | met |" in out
    assert "same first token on both systems in 2 of 2 turns" in out and "1.00 GB/s" in out
    if with_timeline:
        assert "| 2,048 | 1 | 2 | 750.0 ms | 250.0 ms | 66.7% | 100 ms |" in out
        assert "| 4,096 | 0 |" in out
    else:
        assert "no `layer_timeline`" in out


def test_confined_moves_every_thread_and_gives_the_mask_back():
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    child = subprocess.Popen([sys.executable, "-c", "import threading,time; threading.Thread(target=time.sleep, "
                              "args=(30,), daemon=True).start(); time.sleep(30)"])
    try:
        import time
        time.sleep(0.3)
        before = os.sched_getaffinity(child.pid)
        with handover.confined([child.pid], cores[-1]):
            tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
            assert len(tids) >= 2 and all(os.sched_getaffinity(t) == {cores[-1]} for t in tids)
        assert all(os.sched_getaffinity(t) == before for t in tids)
    finally:
        child.kill()
        child.wait()
