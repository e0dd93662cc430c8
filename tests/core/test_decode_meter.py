"""DecodeTimeMeter: Little's-law t_d for prediction-based admission."""

import pytest

from conductor.core.estimators import DecodeTimeMeter


def test_none_until_enough_completions():
    m = DecodeTimeMeter(tau_s=100.0, min_completions=3)
    m.set_decoding(0.0, 10)
    m.completed(1.0, 2)
    assert m.mean_decode_s(2.0) is None
    m.completed(3.0)
    assert m.mean_decode_s(3.0) is not None


def test_steady_state_is_occupancy_over_throughput():
    # 50 sequences decoding at all times, 2 finishing per second -> t_d = 25 s.
    m = DecodeTimeMeter(tau_s=30.0)
    m.set_decoding(0.0, 50)
    for k in range(1, 2001):
        m.completed(k * 0.5)
    assert m.mean_decode_s(1000.0) == pytest.approx(25.0, rel=0.02)


def test_filling_pool_is_not_biased_low_like_the_completed_mean():
    # Every sequence decodes for 100 s except every 10th, which takes 10 s; one joins per second.
    # At t = 60 s only short ones have finished: their mean is 10 s, the truth (in steady state) 91 s.
    m = DecodeTimeMeter(tau_s=300.0, min_completions=1)
    events = []
    for i in range(60):
        events.append((float(i), +1))
        events.append((i + (10.0 if i % 10 == 0 else 100.0), -1))
    n, done = 0, []
    for t, d in sorted(events):
        if t > 60.0:
            break
        n += d
        if d < 0:
            m.completed(t)
            done.append(10.0)
        m.set_decoding(t, n)
    assert sum(done) / len(done) == 10.0
    assert m.mean_decode_s(60.0) > 91.0
