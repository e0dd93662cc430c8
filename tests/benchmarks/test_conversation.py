"""The conversation benchmark's summary (the runs themselves start real clusters)."""

import pytest

from benchmarks.conversation import summarize


def turn(tokens: int, ttft: float, cached: int | None, text: str = "t") -> dict:
    return {"prompt_tokens": tokens, "ttft_s": ttft, "cached_tokens": cached, "text": text, "reference": "t"}


def test_summary_medians_ratios_and_sums_over_later_turns():
    results = {
        "fetch": [[turn(100, 1.0, 0), turn(350, 0.2, 256)], [turn(100, 3.0, None), turn(350, 0.4, 256)]],
        "no-fetch": [[turn(100, 1.0, 0), turn(350, 0.5, 0)], [turn(100, 1.0, 0), turn(350, 0.3, 128)]],
    }
    rows, totals, same = summarize(results, 2)
    assert rows[0]["ttft_s"] == {"fetch": 2.0, "no-fetch": 1.0} and rows[0]["ratio"] == 2.0
    assert rows[1]["cached_tokens"] == {"fetch": 256, "no-fetch": 64} and rows[1]["prompt_tokens"] == 350
    assert rows[1]["ratio"] == pytest.approx(0.3 / 0.4)
    assert totals == pytest.approx({"fetch": 0.6, "no-fetch": 0.8})  # turn 1 is never cached: left out
    assert same == {"fetch": 4, "no-fetch": 4}
    results["no-fetch"][1][1]["text"] = "other"
    assert summarize(results, 2)[2] == {"fetch": 4, "no-fetch": 3}
