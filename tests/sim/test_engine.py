import json

import pytest

from conductor.core import SchedulerConfig, load_profile
from conductor.sim.cli import main, simulate
from conductor.sim.report import summarize
from conductor.sim.trace import TraceParams, TraceRecord, generate_trace, records_of, write_trace

PROFILE = load_profile("paper-70b-8gpu")


def decode_pool():
    from conductor.core.index import PrefixIndex
    from conductor.sim.instances import BlockPool

    return BlockPool("d0", 100, PrefixIndex())


@pytest.fixture(scope="module")
def small_trace():
    return records_of(generate_trace(TraceParams(n_requests=300, rate_rps=3.0, n_prefixes=20, output_median=100,
                                              seed=2)))


def test_every_request_is_accounted_for_and_the_run_is_deterministic(small_trace):
    cfg = SchedulerConfig(admission="baseline")
    a = summarize(simulate(small_trace, cfg, PROFILE, 2, 2), 30, 0.1)
    b = summarize(simulate(small_trace, cfg, PROFILE, 2, 2), 30, 0.1)
    assert a["requests"] == 300 == a["completed"] + a["rejected"]
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("sim_")}  # noqa: E731
    assert strip(a) == strip(b)


def test_noise_free_single_request_matches_the_estimators():
    rec = [TraceRecord(1, 0.0, 5120, 11, tuple(range(10)))]
    res = simulate(rec, SchedulerConfig(admission="none"), PROFILE, 1, 1, noise_sigma=0.0)
    (o,) = res.outcomes
    from conductor.core import Estimators
    est = Estimators.from_profile(PROFILE)
    assert o.ttft_s == pytest.approx(est.prefill_s(5120, 0))
    # 10 decode steps after the first token, plus the KV hand-off before the first step.
    assert o.tbt_s == pytest.approx((0.005 + sum(est.tbt_s(1, 5120 + k) for k in range(10))) / 10, rel=1e-6)


def test_repeated_prefix_hits_the_cache():
    rows = [TraceRecord(i, i * 10_000.0, 5120, 2, tuple(range(10))) for i in range(2)]
    res = simulate(rows, SchedulerConfig(admission="none", policy="cache-aware"), PROFILE, 2, 1, noise_sigma=0.0)
    first, second = sorted(res.outcomes, key=lambda o: o.rid)
    assert second.ttft_s < 0.2 * first.ttft_s


@pytest.mark.parametrize("policy", ["random", "load-balance", "cache-aware", "kvcache-centric"])
def test_no_prefill_pool_replays_a_colocated_cluster(policy):
    # 10k-token prompts are far over the one-step budget; with no prefill pool they still run, on
    # the decode nodes, and a running request's TBT pays for the other's prefill step.
    rows = [TraceRecord(0, 0.0, 10240, 50, tuple(range(20))), TraceRecord(1, 100.0, 10240, 50, tuple(range(100, 120)))]
    res = simulate(rows, SchedulerConfig(admission="prediction", policy=policy), PROFILE, 0, 1, noise_sigma=0.0)
    s = summarize(res, 30, 0.1)
    assert s["completed"] == 2 == s["colocated_prefills"]
    first, second = sorted(res.outcomes, key=lambda o: o.rid)
    from conductor.core import Estimators
    prefill = Estimators.from_profile(PROFILE).prefill_s(10240, 0)
    assert first.tbt_s > prefill / 49  # its batch stalled for the second prompt's whole prefill
    assert second.ttft_s >= prefill


def test_decode_node_reuses_the_prefix_it_prefilled_itself():
    rows = [TraceRecord(i, i * 60_000.0, 5120, 2, tuple(range(10))) for i in range(2)]
    res = simulate(rows, SchedulerConfig(admission="none", policy="cache-aware"), PROFILE, 0, 2, noise_sigma=0.0)
    first, second = sorted(res.outcomes, key=lambda o: o.rid)
    assert second.ttft_s < 0.2 * first.ttft_s
    none = simulate(rows, SchedulerConfig(admission="none", policy="cache-aware"), PROFILE, 0, 2, noise_sigma=0.0,
                    decode_cache_blocks=0)
    assert sorted(none.outcomes, key=lambda o: o.rid)[1].ttft_s == pytest.approx(first.ttft_s)


def test_a_prefill_node_may_fetch_a_prefix_held_by_a_decode_node():
    # While the prefill node is busy, a short prompt is prefilled on the decode node (conditional
    # disaggregation) and cached there; a long prompt sharing its blocks later fetches them.
    busy = TraceRecord(0, 0.0, 60_000, 2, ())
    short = TraceRecord(1, 100.0, 600, 2, (1, 2))  # 0.08 s: fits one 0.1 s step; block 1 is full
    long = TraceRecord(2, 60_000.0, 40_000, 2, (1,) + tuple(range(100, 178)))
    cfg = SchedulerConfig(admission="none", kvcache_balancing_threshold=1.0, colocate_max_new_tokens=2048)
    res = simulate([busy, short, long], cfg, PROFILE, 1, 1, noise_sigma=0.0, bandwidth_Bps=1e12)
    assert summarize(res, 30, 0.1)["colocated_prefills"] == 1
    from conductor.core import Estimators
    last = max(res.outcomes, key=lambda o: o.rid)
    assert last.status == "completed" and last.ttft_s < Estimators.from_profile(PROFILE).prefill_s(40_000, 0)


def test_kvcache_centric_fetches_rather_than_queueing_behind_the_holder():
    # Request 0 caches prefix A on one node; then a burst of A-prefixed prompts arrives at once.
    rows = [TraceRecord(0, 0.0, 20480, 2, tuple(range(40)))]
    rows += [TraceRecord(i, 10_000.0, 20480 + 512, 2, tuple(range(40)) + (1000 + i,)) for i in range(1, 5)]
    ca = summarize(simulate(rows, SchedulerConfig(admission="none", policy="cache-aware"), PROFILE, 4, 1,
                            noise_sigma=0.0), 30, 0.1)
    kc = summarize(simulate(rows, SchedulerConfig(admission="none", policy="kvcache-centric"), PROFILE, 4, 1,
                            noise_sigma=0.0), 30, 0.1)
    assert kc["mean_ttft_s"] <= ca["mean_ttft_s"]


def test_baseline_wastes_prefill_when_decode_is_full():
    rows = [TraceRecord(i, i * 10.0, 8192, 4000, ()) for i in range(6)]
    sim = dict(decode_kv_capacity_tokens=20_000)
    base = summarize(simulate(rows, SchedulerConfig(admission="baseline"), PROFILE, 4, 1, **sim), 30, 0.1)
    early = summarize(simulate(rows, SchedulerConfig(admission="early"), PROFILE, 4, 1, **sim), 30, 0.1)
    assert base["wasted_prefills"] > 0 and base["rejected_by_reason"].get("decode_no_capacity")
    assert early["rejected"] >= 1


def test_cli_json_and_plots(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    write_trace(generate_trace(TraceParams(n_requests=60, rate_rps=2.0, seed=3)), p)
    assert main(["--trace", str(p), "--prefill", "2", "--decode", "2", "--json", "--plot", str(tmp_path / "pl"),
                 "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("requests", "completed", "rejected", "mean_ttft_s", "p90_ttft_s", "p90_tbt_s", "slo_attainment",
                "goodput_rps"):
        assert key in out
    assert (tmp_path / "pl" / "ttft_cdf.png").stat().st_size > 1000
    assert (tmp_path / "pl" / "load.png").stat().st_size > 1000


def test_cli_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--trace", "--prefill", "--decode", "--policy", "--admission", "--speedup", "--ttft-slo",
                "--tbt-slo", "--json", "--plot"):
        assert opt in text


def test_requests_waiting_for_kv_room_are_visible_to_the_scheduler():
    from conductor.sim.instances import DecodeNode, Job

    d = DecodeNode("d0", kv_capacity=10_000, bandwidth_Bps=1e9, cache=decode_pool())
    d.join(Job(0, 0.0, 9000, 100, (), "d0", 1.0, 1.0), 0.0)
    d.waiting.append(Job(1, 0.0, 5000, 100, (), "d0", 1.0, 1.0))
    snap = d.snapshot(2.0)
    assert len(snap.running) == 1 and [s.kv_tokens for s in snap.incoming] == [5000]


def test_shell_reports_littles_law_decode_time_not_the_completed_mean(small_trace):
    from conductor.core import Estimators
    from conductor.core.scheduler import Scheduler
    from conductor.sim.cost_model import CostModel, CostModelConfig
    from conductor.sim.engine import SimConfig, Simulation

    est = Estimators.from_profile(PROFILE)
    seen = {}
    for mode in ("little", "mean"):
        sim = Simulation(small_trace, Scheduler(SchedulerConfig(admission="prediction"), est),
                         CostModel(est, CostModelConfig()), SimConfig(n_prefill=2, n_decode=2, decode_time=mode))
        sim.run()
        seen[mode] = sim._state(sim.outcomes[-1].finish_s or 0.0).mean_decode_s
    assert seen["little"] is not None and seen["mean"] is not None and seen["little"] != seen["mean"]
    with pytest.raises(ValueError):
        SimConfig(decode_time="median")


def test_decode_hold_turns_late_refusals_into_admissions():
    rows = [TraceRecord(i, i * 10.0, 8192, 400, ()) for i in range(6)]
    sim = dict(decode_kv_capacity_tokens=20_000)
    refuse = summarize(simulate(rows, SchedulerConfig(admission="baseline"), PROFILE, 4, 1, **sim), 30, 0.1)
    held = summarize(simulate(rows, SchedulerConfig(admission="baseline", decode_hold_s=600.0), PROFILE, 4, 1, **sim),
                     30, 0.1)
    short = summarize(simulate(rows, SchedulerConfig(admission="baseline", decode_hold_s=1.0), PROFILE, 4, 1, **sim),
                      30, 0.1)
    assert refuse["wasted_prefills"] == 4 and short["wasted_prefills"] == 4
    assert held["wasted_prefills"] == 0 and held["completed"] == 6
    with pytest.raises(ValueError):
        SchedulerConfig(decode_hold_s=-1.0)


def test_held_request_that_can_never_fit_is_refused_at_once():
    rows = [TraceRecord(0, 0.0, 30_000, 10, ())]
    s = summarize(simulate(rows, SchedulerConfig(admission="baseline", decode_hold_s=600.0), PROFILE, 1, 1,
                           decode_kv_capacity_tokens=20_000), 30, 0.1)
    assert s["rejected_by_reason"] == {"decode_no_capacity": 1} and s["makespan_s"] < 60


def test_oracle_lengths_reach_the_scheduler_only_when_asked():
    from conductor.sim.instances import DecodeNode, Job

    for oracle, want in ((False, [None, None]), (True, [99 - 3, 49])):
        d = DecodeNode("d0", kv_capacity=100_000, bandwidth_Bps=1e9, cache=decode_pool(), oracle_lengths=oracle)
        d.join(Job(0, 0.0, 1000, 100, (), "d0", 1.0, 1.0), 0.0)
        d.step = 3  # three decode steps done
        d.expect(Job(1, 0.0, 2000, 50, (), "d0", 1.0, 5.0))
        snap = d.snapshot(4.0)
        assert [snap.running[0].remaining_tokens, snap.incoming[0].remaining_tokens] == want
        assert snap.lengths_known is oracle


def test_summary_counts_prompt_tokens_served(small_trace):
    s = summarize(simulate(small_trace, SchedulerConfig(admission="none"), PROFILE, 2, 2), 1e9, 1e9)
    done = [r for r in small_trace]
    assert s["completed"] == len(done) and s["completed_within_slo"] == len(done)
    assert s["prompt_tokens_within_slo"] == sum(r.input_length for r in done)
    assert s["mean_prompt_completed"] == pytest.approx(s["prompt_tokens_within_slo"] / len(done))


def test_unsorted_trace_starts_at_its_earliest_timestamp():
    rows = [TraceRecord(1, 5000.0, 512, 2, ()), TraceRecord(2, 1000.0, 512, 2, ())]
    res = simulate(rows, SchedulerConfig(admission="none"), PROFILE, 1, 1, noise_sigma=0.0)
    assert sorted(o.arrival_s for o in res.outcomes) == [0.0, 4.0]


def test_cli_unwritable_plot_dir_is_an_error_not_a_traceback(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    write_trace(generate_trace(TraceParams(n_requests=5, seed=1)), trace)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(["--trace", str(trace), "--json", "--no-progress", "--plot", str(blocker / "plots")]) == 2
    out = capsys.readouterr()
    assert "cannot write plots" in out.err and json.loads(out.out)["requests"] == 5


@pytest.mark.parametrize("admission", ["none", "baseline", "early", "prediction"])
def test_prompt_larger_than_any_decode_node_is_refused_not_lost(admission):
    """Under "none" it used to wait for KV room forever and vanish from the counts, blocking the
    small request queued behind it on the same node."""
    cap = 100_000
    rows = [TraceRecord(1, 0.0, 2 * cap, 4, ()), TraceRecord(2, 1.0, 1000, 4, ())]
    res = simulate(rows, SchedulerConfig(admission=admission, ttft_slo_s=1e6), PROFILE, 1, 1,
                   decode_kv_capacity_tokens=cap)
    status = {o.rid: (o.status, o.reason) for o in sorted(res.outcomes, key=lambda o: o.rid)}
    assert status[0][0] == "rejected" and "no_capacity" in status[0][1]
    assert status[1] == ("completed", None)


def test_colocated_prompt_larger_than_the_decode_node_is_refused_not_lost():
    """With no prefill pool and admission "none" it waited at the head of the decode node's queue
    forever, and the run ended in a RuntimeError (requests neither completed nor rejected)."""
    cap = 100_000
    rows = [TraceRecord(1, 0.0, 2 * cap, 4, ()), TraceRecord(2, 1.0, 1000, 4, ())]
    res = simulate(rows, SchedulerConfig(admission="none", ttft_slo_s=1e6), PROFILE, 0, 1,
                   decode_kv_capacity_tokens=cap)
    status = {o.rid: (o.status, o.reason, o.colocated) for o in res.outcomes}
    assert status == {0: ("rejected", "decode_no_capacity", True), 1: ("completed", None, True)}


def test_cli_reports_a_failed_simulation_as_an_error_not_a_traceback(tmp_path, capsys, monkeypatch):
    from conductor.sim.engine import Simulation

    def broken(self):
        raise RuntimeError("simulation ended with 1 of 2 requests neither completed nor rejected")

    monkeypatch.setattr(Simulation, "run", broken)
    trace = tmp_path / "t.jsonl"
    write_trace(generate_trace(TraceParams(n_requests=2, seed=1)), trace)
    assert main(["--trace", str(trace), "--json", "--no-progress"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err
    assert "mooncake sim: error: the simulation failed: simulation ended with 1 of 2 requests" in out.err


def _burst_sim(pending: bool):
    from conductor.core import Estimators, Scheduler
    from conductor.sim.cost_model import CostModel, CostModelConfig
    from conductor.sim.engine import SimConfig, Simulation

    # 16 prompts sharing a new 40-block prefix, one every 0.2 s, on a cold 4-node prefill pool.
    rows = [TraceRecord(i, i * 200.0, 20480 + 512, 2, tuple(range(40)) + (1000 + i,)) for i in range(16)]
    est = Estimators.from_profile(PROFILE)
    sim = Simulation(rows, Scheduler(SchedulerConfig(admission="none", policy="cache-aware"), est),
                     CostModel(est, CostModelConfig(noise_sigma=0.0)),
                     SimConfig(n_prefill=4, n_decode=1, pending_prefixes=pending))
    return sim, sim.run()


def test_requests_queued_behind_a_prefill_of_their_prefix_are_priced_with_it():
    # Counting pending blocks, the burst queues behind the first prompt on one node, which computes
    # the shared prefix once; blind to them, every idle node computes its own copy.
    sim_on, res_on = _burst_sim(True)
    sim_off, _ = _burst_sim(False)
    busy_on = sorted(p.busy_s for p in sim_on.prefills.values())
    busy_off = sorted(p.busy_s for p in sim_off.prefills.values())
    assert busy_on[:3] == [0.0, 0.0, 0.0]
    assert sum(busy_on) < 0.5 * sum(busy_off)
    assert sum(b > 2.0 for b in busy_off) >= 2  # the prefix (~3 s) computed on more than one node
    assert len(sim_on.pending) == 0 == len(sim_off.pending or ())  # every pending block released
    assert all(o.status == "completed" for o in res_on.outcomes)


def test_cli_can_ignore_pending_prefixes(tmp_path, capsys):
    rows = generate_trace(TraceParams(n_requests=200, rate_rps=4.0, n_prefixes=5, prefix_blocks_mean=40,
                                      suffix_tokens_median=500, seed=3))
    write_trace(rows, tmp_path / "t.jsonl")
    ttft = []
    for flag in ([], ["--no-pending-prefixes"]):
        assert main(["--trace", str(tmp_path / "t.jsonl"), "--json", "--no-progress", "--admission", "none",
                     "--policy", "cache-aware", *flag]) == 0
        ttft.append(json.loads(capsys.readouterr().out)["mean_ttft_s"])
    assert ttft[0] != ttft[1]


def test_cli_fitted_replays_a_live_clusters_calibration(tmp_path, capsys):
    write_trace(generate_trace(TraceParams(n_requests=40, rate_rps=1.0, seed=4)), tmp_path / "t.jsonl")
    base = ["--trace", str(tmp_path / "t.jsonl"), "--json", "--no-progress", "--prefill", "1", "--decode", "1",
            "--admission", "none"]

    def run(*flags):
        assert main([*base, *flags]) == 0
        return json.loads(capsys.readouterr().out)

    def saved(prefill_scale):
        path = tmp_path / f"est-{prefill_scale}.json"
        path.write_text(json.dumps({"profile": "paper-70b-8gpu", "instances": {
            "p": {"prefill": {"scale": prefill_scale, "samples": 9}, "decode_step": {"scale": 1.0, "samples": 0}}}}))
        return str(path)

    prior = run()
    slow = run("--fitted", saved(3.0))
    assert slow["profile"] == "paper-70b-8gpu-fitted" and slow["mean_ttft_s"] > 2 * prior["mean_ttft_s"]
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main([*base, "--fitted", str(tmp_path / "bad.json")]) == 2
    assert "estimators" in capsys.readouterr().err


def test_an_idle_gap_of_years_between_arrivals_is_crossed_at_once():
    """Nothing changes between events: the timeline's samples wait for the next one rather than
    tick through a gap (a trace mixing relative and epoch timestamps hung the simulator)."""
    import time

    recs = [TraceRecord(1, 0.0, 1024, 4, (1, 2)), TraceRecord(2, 1.7e12, 1024, 4, (3, 4))]
    start = time.perf_counter()
    res = simulate(recs, SchedulerConfig(admission="none"), PROFILE, 1, 1, noise_sigma=0.0)
    assert time.perf_counter() - start < 10
    assert [o.status for o in res.outcomes] == ["completed", "completed"]
