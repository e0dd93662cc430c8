"""The compute ceiling's arithmetic (benchmarks/compute_ceiling.py); the engines it measures are
started only by the benchmark itself."""

import pytest

from benchmarks.compute_ceiling import EngineSpeed, ceiling_rps, share_lines


def test_ceiling_takes_the_better_use_of_the_cores():
    # One engine on two cores scales imperfectly: two one-core engines prefill more in all.
    both = EngineSpeed(cores=2, prefill_s=1.6, decode_s=1.0, prompt_tokens=2000)
    one = EngineSpeed(cores=1, prefill_s=2.8, decode_s=1.5, prompt_tokens=2000)
    assert ceiling_rps(both, one, cores=2, mean_prompt=2000) == pytest.approx(2 / 2.8)
    # ... and the other way round when the one-core engine is slower than half.
    slow_one = EngineSpeed(cores=1, prefill_s=4.0, decode_s=1.5, prompt_tokens=2000)
    assert ceiling_rps(both, slow_one, cores=2, mean_prompt=2000) == pytest.approx(1 / 1.6)
    # By tokens/s: measured prompts shorter than the workload's mean do not raise the ceiling.
    short = EngineSpeed(cores=2, prefill_s=0.8, decode_s=1.0, prompt_tokens=1000)
    assert ceiling_rps(short, slow_one, cores=2, mean_prompt=2000) == pytest.approx(1 / 1.6)


def test_share_lines_say_whether_the_goal_fits_under_the_ceiling():
    lines = share_lines({"vllm": 0.5, "ours": 0.25, "vllm-mooncake": None}, ceiling=0.6)
    assert lines[0] == "- vllm: SLO capacity 0.5 req/s = 0.83 of the ceiling"
    assert "no rate reached 90 %" in lines[2]
    assert "0.65 req/s = 1.08 of the ceiling (at or above the ceiling: cannot be met" in lines[3]
    fits = share_lines({"vllm": 0.25}, ceiling=0.6)
    assert "0.325 req/s = 0.54 of the ceiling (below the ceiling" in fits[-1]
    assert share_lines({"ours": 0.5}, ceiling=0.6) == ["- ours: SLO capacity 0.5 req/s = 0.83 of the ceiling"]
