"""The simulator with flexible roles (conductor/sim/flex.py): every node one engine that prefills
in chunks beside its batch and decodes, labels only a cost, as the live cluster runs by default."""

import json

import pytest

from conductor.config import live_scheduler_config
from conductor.core import Estimators, SchedulerConfig, load_profile
from conductor.core.scheduler import Scheduler
from conductor.sim.cli import main, simulate
from conductor.sim.cost_model import CostModel, CostModelConfig
from conductor.sim.engine import SimConfig, Simulation
from conductor.sim.flex import FlexSimulation
from conductor.sim.report import summarize
from conductor.sim.trace import TraceParams, TraceRecord, generate_trace, records_of, write_trace
from mooncake import defaults

LIVE = load_profile(defaults.profile_name(defaults.PROFILE, "bfloat16"))  # one CPU core per engine


def fresh(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + -(-n // defaults.KV_BLOCK_SIZE)))


def flexible(**over) -> SchedulerConfig:
    return live_scheduler_config(**{"ttft_slo_s": 30.0, "tbt_slo_s": 0.25, "flexible_roles": True, **over})


def test_a_busy_prefill_node_leaves_prompts_to_the_decode_node():
    """Six 3,000-token prompts at once: the prefill-labelled node alone would take them one after
    another. With flexible roles the decode-labelled one prefills some (its own, or for the other
    to decode), and the requests get their first tokens sooner than with fixed roles. Their
    max_tokens (64) are known, as live: the decode node may then make the sequences coming to it
    absorb its prefill over their tokens."""
    trace = [TraceRecord(i + 1, 0.0, 3000, 64, fresh(3000, 100 * i)) for i in range(6)]
    fixed = simulate(trace, flexible(flexible_roles=False), LIVE, 1, 1, noise_sigma=0.0, max_tokens_known=True)
    flex = simulate(trace, flexible(), LIVE, 1, 1, noise_sigma=0.0, max_tokens_known=True)
    s_fixed, s_flex = summarize(fixed, 30.0, 0.25), summarize(flex, 30.0, 0.25)
    assert s_flex["completed"] == 6 == s_fixed["completed"]
    assert set(s_fixed["routes"]) == {"disaggregated"}
    assert s_flex["routes"].get("colocated", 0) + s_flex["routes"].get("flexible", 0) >= 2
    assert s_flex["p90_ttft_s"] < 0.8 * s_fixed["p90_ttft_s"]


def test_a_prompt_beside_a_running_batch_runs_in_chunks_each_one_a_short_gap():
    """One engine (no prefill node). A sequence is decoding when a 3,000-token prompt arrives: with
    flexible roles it is computed in steps of chunk_tokens, each also stepping the batch, so no gap
    between the running sequence's tokens is longer than one chunk's step. The fixed-roles model
    runs it whole in one step: one gap of the whole prefill."""
    est = Estimators.from_profile(LIVE)
    whole = est.prefill_s(3000, 0)
    trace = [TraceRecord(1, 0.0, 300, 200, fresh(300)), TraceRecord(2, 1000.0, 3000, 4, fresh(3000, 100))]
    loose = dict(tbt_slo_s=5.0, chunk_tokens=256, colocate_max_new_tokens=4096)
    flex = simulate(trace, flexible(**loose), LIVE, 0, 1, noise_sigma=0.0)
    fixed = simulate(trace, flexible(flexible_roles=False, **loose), LIVE, 0, 1, noise_sigma=0.0)
    assert all(o.status == "completed" for o in flex.outcomes + fixed.outcomes)
    longest_flex = max(d for d, batch in flex.step_times if batch)
    assert longest_flex < est.prefill_s(3000, 3000 - 256) + est.tbt_s(2, 3300) + 1e-9 < whole / 5
    assert max(d for d, batch in fixed.step_times if batch) > whole
    # The chunks add up to the prompt: its first token comes no sooner than the whole prefill.
    second = next(o for o in flex.outcomes if o.rid == 1)
    assert second.ttft_s >= whole * 0.95


def test_a_decode_node_with_a_batch_is_not_given_chunks_that_break_its_tbt():
    """With the workers' default 2,048-token step a one-core engine cannot prefill beside a batch
    within a 0.25 s TBT SLO, so a decode node that is decoding is never chosen to prefill, as live."""
    trace = [TraceRecord(1, 0.0, 200, 400, fresh(200))]
    trace += [TraceRecord(i + 2, 2000.0 + 10 * i, 2500, 8, fresh(2500, 100 * (i + 1))) for i in range(4)]
    res = simulate(trace, flexible(), LIVE, 1, 1, noise_sigma=0.0)
    assert max((d for d, batch in res.step_times if batch), default=0.0) <= 0.25
    assert all(o.status == "completed" for o in res.outcomes)


@pytest.mark.parametrize("admission", ["none", "baseline", "early", "prediction"])
def test_every_request_ends_and_the_run_is_deterministic(admission):
    trace = records_of(generate_trace(TraceParams(n_requests=250, rate_rps=1.5, n_prefixes=15, block_size=128,
                                                  suffix_tokens_median=900, output_median=40, max_input=6000,
                                                  seed=3)))
    cfg = flexible(admission=admission, ttft_slo_s=10.0)
    a = summarize(simulate(trace, cfg, LIVE, 2, 2, seed=1), 10.0, 0.25)
    b = summarize(simulate(trace, cfg, LIVE, 2, 2, seed=1), 10.0, 0.25)
    assert a["requests"] == 250 == a["completed"] + a["rejected"]
    assert sum(a["routes"].values()) == 250 - (a["rejected"] - a["wasted_prefills"])
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("sim_")}  # noqa: E731
    assert strip(a) == strip(b)


def test_each_simulation_refuses_the_other_ones_roles():
    est = Estimators.from_profile(LIVE)
    cost = CostModel(est, CostModelConfig())
    with pytest.raises(ValueError, match="FlexSimulation"):
        Simulation([], Scheduler(flexible(), est), cost, SimConfig(1, 1))
    with pytest.raises(ValueError, match="flexible_roles"):
        FlexSimulation([], Scheduler(flexible(flexible_roles=False), est), cost, SimConfig(1, 1))


def test_the_command_line_simulates_flexible_roles(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_trace(generate_trace(TraceParams(n_requests=60, rate_rps=2.0, n_prefixes=5, output_median=30, seed=1)),
                path)
    assert main(["--trace", str(path), "--flexible-roles", "--prefill", "1", "--decode", "2", "--json",
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 60 and sum(out["routes"].values()) > 0
    assert main(["--trace", str(path), "--flexible-roles", "--policy", "random", "--no-progress"]) == 2
    assert "kvcache-centric" in capsys.readouterr().err
