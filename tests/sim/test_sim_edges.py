"""The simulator at its edges: one-token answers, trace and profile block sizes, an overloaded
run's snapshots, and inputs that would make its arithmetic overflow."""

import math
import random
from dataclasses import replace

import pytest

from conductor.core import SchedulerConfig, load_profile
from conductor.core.calibration import cluster_scales, fitted_profile
from conductor.core.index import PrefixIndex
from conductor.core.types import DecodeSeq, InstanceState, Role, SeqTotals
from conductor.sim import cli as sim_cli
from conductor.sim.cli import simulate
from conductor.sim.instances import BlockPool, DecodeNode, Job, _SeqTally
from conductor.sim.trace import TraceRecord

PROFILE = load_profile("paper-70b-8gpu")


def test_a_one_token_answer_needs_no_decode_room():
    # Its only token comes from the prefill: the live conductor answers without D.
    # Prompts that together overflow the decode instance's KV room must not be refused for it.
    small_decode = replace(PROFILE, decode_kv_capacity_tokens=6000)
    rows = [TraceRecord(i, 0.0, 5120, 1, tuple(range(10 * i, 10 * i + 10))) for i in range(6)]
    for admission in ("none", "baseline", "early", "prediction"):  # the last two refused them at arrival
        cfg = SchedulerConfig(admission=admission, ttft_slo_s=1e6, conditional_disaggregation=False)
        res = simulate(rows, cfg, small_decode, 2, 1, noise_sigma=0.0)
        assert [o.status for o in res.outcomes] == ["completed"] * 6, (admission, res.outcomes)
        for o in res.outcomes:
            assert o.finish_s == pytest.approx(o.arrival_s + o.ttft_s)  # done with its first token


def test_the_prefill_cache_is_counted_in_the_trace_s_blocks(monkeypatch):
    seen = {}

    class Capture(sim_cli.Simulation):
        def __init__(self, trace, scheduler, cost, config):
            seen["config"] = config
            super().__init__(trace, scheduler, cost, config)

    monkeypatch.setattr(sim_cli, "Simulation", Capture)
    profile = replace(PROFILE, block_size=128, prefill_cache_blocks=1000)
    simulate([TraceRecord(1, 0.0, 1024, 2, (1, 2))], SchedulerConfig(admission="none", block_size=512), profile, 1, 1)
    assert seen["config"].prefill_cache_blocks == 250  # 128,000 tokens in blocks of 512
    assert profile.prefill_cache_blocks_of(128) == 1000 and profile.prefill_cache_blocks_of(1 << 20) == 1


def test_a_speedup_that_overflows_the_arrival_times_is_refused():
    rows = [TraceRecord(1, 0.0, 1024, 2, ()), TraceRecord(2, 1000.0, 1024, 2, ())]
    with pytest.raises(ValueError, match="speedup"):
        simulate(rows, SchedulerConfig(admission="none"), PROFILE, 1, 1, speedup=1e-310)


def test_fitted_scales_that_are_not_positive_or_overflow_are_refused():
    doc = {"instances": {"p0": {"prefill": {"samples": 3, "scale": -1.0}, "decode_step": {"samples": 1, "scale": 1.0}}}}
    with pytest.raises(ValueError, match="'p0': prefill scale -1.0"):
        cluster_scales(doc)
    with pytest.raises(ValueError, match="profile time"):
        fitted_profile(PROFILE, 1e308, 1.0)


def _seq(rng: random.Random) -> DecodeSeq:
    return DecodeSeq(rng.random(), rng.randrange(1, 5000), rng.choice([None, rng.randrange(100)]),
                     rng.choice([None, 0.1, 0.25]), rng.choice([None, None, 64]))


def test_the_kept_tally_is_what_summing_the_sequences_gives():
    rng = random.Random(7)
    tally, alive = _SeqTally(), {}
    for i in range(2000):
        if alive and rng.random() < 0.45:
            key = rng.choice(list(alive))
            tally.change(alive.pop(key), -1)
        else:
            alive[i] = _seq(rng)
            tally.change(alive[i], +1)
        assert tally.totals() == SeqTotals.of(tuple(alive.values()))
    seqs = tuple(alive.values())
    given = InstanceState("d0", Role.DECODE, running=seqs[:3], incoming=seqs[3:], incoming_totals=SeqTotals.of(seqs[3:]))
    summed = InstanceState("d0", Role.DECODE, running=seqs[:3], incoming=seqs[3:])
    assert [getattr(given, f) for f in ("kv_tokens", "incoming_kv_tokens", "lengths_known", "tightest_tbt_slo_s",
                                         "any_config_tbt_slo", "any_max_tokens")] == \
        [getattr(summed, f) for f in ("kv_tokens", "incoming_kv_tokens", "lengths_known", "tightest_tbt_slo_s",
                                      "any_config_tbt_slo", "any_max_tokens")]
    assert SeqTotals.of(()) == SeqTotals() and SeqTotals().tightest_tbt_slo_s == math.inf


def test_a_snapshot_reuses_the_sequences_on_their_way():
    # One per arrival, for every decode node: rebuilding a sequence per request on its way made an
    # overloaded run quadratic (16,000 requests: minutes).
    d = DecodeNode("d0", kv_capacity=100_000, bandwidth_Bps=1e9, cache=BlockPool("d0", 100, PrefixIndex()))
    for rid in range(50):
        d.expect(Job(rid, 0.0, 1000 + rid, 10, (), "d0", 1.0, 2.0))
    first, second = d.snapshot(1.0), d.snapshot(1.5)
    assert len(first.incoming) == 50 and all(a is b for a, b in zip(first.incoming, second.incoming))
    assert first.incoming_kv_tokens == sum(1000 + rid for rid in range(50))
    assert d.arrived(7).rid == 7
    assert d.snapshot(2.0).incoming_kv_tokens == first.incoming_kv_tokens - 1007
