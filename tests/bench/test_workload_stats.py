"""The pure parts of `mooncake bench`: prompts from hash ids, arrival schedules, statistics."""

import argparse
import math

import pytest

from mooncake.bench import workload
from mooncake.bench.cli import main
from mooncake.bench.stats import ERROR, OK, REFUSED, RequestRecord, percentiles, slo_capacity, summarize
from mooncake.trace import TraceError, load_trace

KW = dict(block_size=4, vocab_size=2000, seed=7)


def write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_trace_lines_sharing_a_hash_id_share_that_block_exactly(tmp_path):
    p = write(tmp_path, ['{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [5, 6, 7]}',
                         '{"timestamp": 9, "input_length": 12, "output_length": 3, "hash_ids": [5, 8, 7]}'])
    a, b = (workload.prompt_of(s, salt=0, **KW) for s in workload.trace_specs(load_trace(p)))
    assert len(a) == 10 and len(b) == 12
    assert a[:4] == b[:4]                      # hash id 5: the same block
    assert a[4:8] != b[4:8]                    # 6 vs 8: different blocks
    assert a[8:10] == b[8:10]                  # 7, cut to input_length in a
    assert all(workload.LOW_TOKEN_ID <= t < 2000 for t in a + b)
    # deterministic, and a new salt gives the same shape with other ids (no cross-rate cache)
    spec = workload.trace_specs(load_trace(p))[0]
    assert workload.prompt_of(spec, salt=0, **KW) == a
    assert workload.prompt_of(spec, salt=1, **KW) != a


def test_hash_ids_that_differ_never_name_the_same_block(tmp_path):
    """Hash ids were masked to 64 bits: 0 and 2**64, or -1 and 2**64 - 1, gave the same tokens."""
    lines = [f'{{"timestamp": {i}, "input_length": 4, "output_length": 1, "hash_ids": [{h}]}}'
             for i, h in enumerate((0, 2 ** 64, -1, 2 ** 64 - 1, 1))]
    prompts = [tuple(workload.prompt_of(s, salt=0, **KW)) for s in workload.trace_specs(load_trace(write(tmp_path, lines)))]
    assert len(set(prompts)) == 5


def test_trace_tokens_past_the_named_blocks_are_private_and_max_input_len_truncates(tmp_path):
    p = write(tmp_path, ['{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}',
                         '{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": [1]}'])
    specs = workload.trace_specs(load_trace(p), max_input_len=8)
    a, b = (workload.prompt_of(s, salt=0, **KW) for s in specs)
    assert len(a) == len(b) == 8 and a[:4] == b[:4] and a[4:] != b[4:]
    assert [s.max_tokens for s in specs] == [1, 5]  # 0 output tokens is sent as 1 (servers refuse 0)


def test_generated_prompts_are_independent_unless_sharing_a_prefix():
    specs = workload.generated_specs(20, (5, 9), 3, seed=1)
    assert all(5 <= s.input_length <= 9 and s.max_tokens == 3 for s in specs)
    assert len({s.input_length for s in specs}) > 1
    prompts = [workload.prompt_of(s, salt=0, **KW) for s in specs]
    assert prompts[0][:3] != prompts[1][:3]
    shared = [workload.prompt_of(s, salt=0, **KW) for s in workload.generated_specs(3, (8, 8), 3, 1, shared_prefix=5)]
    assert shared[0][:5] == shared[1][:5] == shared[2][:5] and shared[0][5:] != shared[1][5:]


@pytest.mark.parametrize("bad, msg", [
    ("{oops", "not valid JSON"),
    ('{"prompt": "", "max_tokens": 3}', "'prompt'"),
    ('{"prompt": [1, "x"], "max_tokens": 3}', "'prompt'"),
    ('{"prompt": "hi", "max_tokens": 0}', "'max_tokens'"),
    ('{"prompt": "hi"}', "'max_tokens'"),
    ('{"prompt": "a \\ud800", "max_tokens": 3}', "cannot be sent as UTF-8"),  # valid JSON, not UTF-8
])
def test_malformed_prompts_file_line_is_reported_with_its_number(tmp_path, bad, msg):
    p = write(tmp_path, ['{"prompt": "hi", "max_tokens": 3}', "", bad], "p.jsonl")
    with pytest.raises(workload.PromptsFileError, match=msg) as exc:
        workload.load_prompts_file(p)
    assert exc.value.line == 3 and f"{p}:3:" in str(exc.value)


def test_prompts_file_keeps_text_and_token_ids(tmp_path):
    p = write(tmp_path, ['{"prompt": "hello", "max_tokens": 3}', '{"prompt": [1001, 1002], "max_tokens": 4}'])
    specs = workload.load_prompts_file(p)
    assert [workload.prompt_of(s, salt=3, **KW) for s in specs] == ["hello", [1001, 1002]]
    assert [s.max_tokens for s in specs] == [3, 4]


@pytest.mark.parametrize("flag", ["--trace", "--prompts-file"])
def test_bench_reports_a_bad_input_line_and_exits_2_before_any_request(tmp_path, capsys, flag):
    p = write(tmp_path, ['{"timestamp": 0, "input_length": 4, "output_length": 1, "prompt": "a", "max_tokens": 1}',
                         "[1]"])
    # the URL is unreachable: the input must be refused first
    assert main([flag, str(p), "--url", "http://127.0.0.1:1/v1"]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "Traceback" not in err


def test_poisson_schedule_is_seeded_and_scales_with_rate():
    a = workload.poisson_offsets(2000, 2.0, seed=3)
    assert a == workload.poisson_offsets(2000, 2.0, seed=3) and a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert workload.offered_rate(a) == pytest.approx(2.0, rel=0.1)
    assert workload.poisson_offsets(2000, 4.0, seed=3) == pytest.approx([x / 2 for x in a])
    assert workload.poisson_offsets(10, 2.0, seed=4) != a[:10]


def test_trace_schedule_starts_at_zero_and_scales():
    specs = [workload.RequestSpec(i, 1, 1, timestamp_ms=t) for i, t in enumerate([1000.0, 1500.0, 3000.0])]
    assert workload.trace_offsets(specs, 1.0) == [0.0, 0.5, 2.0]
    assert workload.trace_offsets(specs, 0.5) == [0.0, 0.25, 1.0]


def rec(i, status=OK, ttft=0.5, tbt=0.05, tokens=5, sent=0.0, max_tokens=5, usage=True):
    r = RequestRecord(i, 100, max_tokens, scheduled_s=sent, sent_s=sent, status=status, tokens=tokens,
                      tokens_from_usage=usage)
    if status == OK:
        r.first_token_s = sent + ttft
        r.chunk_s = [sent + ttft + k * tbt for k in range(tokens)]
        r.end_s = r.chunk_s[-1]
    else:
        r.end_s = sent + 0.01
    return r


def test_latencies_of_a_record():
    r = rec(0, ttft=0.4, tbt=0.1, tokens=5, sent=2.0)
    assert r.ttft_s == pytest.approx(0.4) and r.mean_tbt_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.8) and r.tbt_gaps_s == pytest.approx([0.1] * 4)
    # several tokens in one chunk: the mean uses the token count, not the chunk count
    r.chunk_s, r.tokens = [2.4, 2.8], 5
    assert r.mean_tbt_s == pytest.approx(0.1)
    assert rec(1, status=REFUSED).ttft_s is None and rec(2, status=ERROR).e2e_s is None


def test_attainment_and_goodput_count_refusals_and_errors_as_misses():
    records = [rec(0, ttft=0.5, sent=0.0), rec(1, ttft=2.5, sent=1.0),            # TTFT miss
               rec(2, tbt=0.3, sent=2.0), rec(3, status=REFUSED, sent=3.0),       # TBT miss, refusal
               rec(4, status=ERROR, sent=4.0), rec(5, ttft=0.1, tokens=1, sent=9.0)]  # 1 token: no TBT to miss
    s = summarize(records, offered_rate=1.0, ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert (s.requests, s.completed, s.refused, s.errors) == (6, 4, 1, 1)
    assert s.attainment == pytest.approx(2 / 6)
    assert s.duration_s == pytest.approx(9.1)  # first send 0.0, last end 9.1
    # the smaller of attainment x offered rate and attaining requests over the duration: neither
    # more than was offered nor more than was served
    assert s.goodput == pytest.approx(min(2 / 6 * 1.0, 2 / 9.1))
    fast = summarize(records, offered_rate=0.1, ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert fast.goodput == pytest.approx(2 / 6 * 0.1)
    one = summarize([rec(0, ttft=0.1, tokens=1, sent=0.0)], offered_rate=1.0, ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert one.goodput == pytest.approx(1.0)  # was 10 req/s: one request over its own 0.1 s
    at_once = summarize(records, offered_rate=float("inf"), ttft_slo_s=1.0, tbt_slo_s=0.1)
    assert at_once.goodput == pytest.approx(2 / 9.1)  # no rate offered: over the run's duration
    # latency percentiles over completed requests only: no zero from the refusal or the error
    assert s.ttft_s == pytest.approx(percentiles([0.5, 2.5, 0.5, 0.1], (50, 90, 99)))
    assert s.tbt_s["p50"] == pytest.approx(0.05)


def test_short_outputs_are_counted():
    s = summarize([rec(0, tokens=3, max_tokens=5), rec(1)], 1.0, 1.0, 1.0)
    assert s.short_outputs == 1 and s.without_usage == 0


def test_outputs_counted_in_chunks_are_not_called_short():
    """Without the server's usage count a chunk may carry several tokens: fewer chunks than
    max_tokens proves nothing, and the table says the counts are per chunk."""
    from mooncake.bench.report import table

    s = summarize([rec(0, tokens=3, max_tokens=5, usage=False), rec(1)], 1.0, 1.0, 1.0)
    assert s.short_outputs == 0 and s.without_usage == 1
    text = table([s], 1.0, 0.9)
    assert "sent no usage count for 1 answers" in text and "shorter than max_tokens" not in text


def test_percentiles_and_empty_runs():
    assert percentiles([1, 2, 3, 4, 5], (50, 90)) == {"p50": 3.0, "p90": pytest.approx(4.6)}
    assert percentiles([], (50, 99)) == {"p50": None, "p99": None}
    s = summarize([rec(0, status=REFUSED)], 1.0, 1.0, 1.0)
    assert s.attainment == 0.0 and s.ttft_s["p50"] is None and not math.isnan(s.goodput)


def test_slo_capacity_is_the_highest_rate_meeting_the_target():
    def at(rate, attained, n=10):
        recs = [rec(i) for i in range(attained)] + [rec(i, status=REFUSED) for i in range(attained, n)]
        return summarize(recs, rate, 1.0, 1.0)
    sweep = [at(0.25, 10), at(0.5, 9), at(1.0, 8), at(2.0, 2)]
    assert slo_capacity(sweep, 0.9) == 0.5
    assert slo_capacity(sweep, 0.8) == 1.0
    assert slo_capacity([at(1.0, 5)], 0.9) is None


def test_attainment_is_printed_with_one_decimal():
    """896 of 1000 printed as a whole 90% read as meeting a 90% target that it missed."""
    from mooncake.bench.report import table

    recs = [rec(i) for i in range(896)] + [rec(i, status=REFUSED) for i in range(896, 1000)]
    s = summarize(recs, 1.0, 1.0, 1.0)
    text = table([s], slo_capacity([s], 0.9), 0.9)
    assert " 89.6% " in text and " 90% " not in text
    assert "attainment >= 90.0%): none" in text


def test_a_capacity_above_a_rate_that_missed_the_target_is_warned_about():
    """The capacity keeps its definition (the highest rate meeting the target), but a lower rate
    that missed it says that attainment was not monotonic in the rate."""
    from mooncake.bench.report import table
    from mooncake.bench.stats import lower_rates_missing

    def at(rate, attained, n=10):
        recs = [rec(i) for i in range(attained)] + [rec(i, status=REFUSED) for i in range(attained, n)]
        return summarize(recs, rate, 1.0, 1.0)
    sweep = [at(0.5, 10), at(1.0, 7), at(2.0, 9), at(4.0, 1)]
    assert slo_capacity(sweep, 0.9) == 2.0
    assert [s.offered_rate for s in lower_rates_missing(sweep, 0.9, 2.0)] == [1.0]
    text = table(sweep, 2.0, 0.9)
    assert "warning: lower rates missed the target: 1 req/s (70.0%)" in text and "capacity of 2 req/s" in text
    monotonic = [at(0.5, 10), at(1.0, 9), at(2.0, 5)]
    assert lower_rates_missing(monotonic, 0.9, 1.0) == [] and "warning" not in table(monotonic, 1.0, 0.9)


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", "more than 4300 digits"),
    ('{"prompt": "hi", "max_tokens": 3, "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ('{"prompt": "hi", "max_tokens": 1' + "0" * 400 + "}", "'max_tokens' must be an integer in [1, 10,000,000]"),
])
def test_a_prompts_file_line_python_cannot_read_is_an_error_naming_the_line(tmp_path, line, msg):
    p = write(tmp_path, ['{"prompt": "hi", "max_tokens": 3}', line], "p.jsonl")
    with pytest.raises(workload.PromptsFileError) as exc:
        workload.load_prompts_file(p)
    assert str(exc.value).startswith(f"{p}:2: ") and msg in str(exc.value) and len(str(exc.value)) < 200


@pytest.mark.parametrize("flags, needle", [
    (["--ttft-slo", "nan"], "--ttft-slo must be a finite number > 0, got nan"),
    (["--tbt-slo", "nan"], "--tbt-slo must be a finite number > 0, got nan"),
    (["--ttft-slo", "inf"], "--ttft-slo must be a finite number > 0, got inf"),
    (["--max-retry-wait", "nan"], "--max-retry-wait must be a finite number of seconds >= 0, got nan"),
    (["--time-scale", "nan"], "--time-scale must be a finite number > 0, got nan"),
    (["--time-scale", "inf"], "--time-scale must be a finite number > 0, got inf"),
    (["--attainment-target", "nan"], "--attainment-target must be in (0, 1], got nan"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--input-len", "100000000000"], "--input-len must be N or MIN-MAX with 1 <= MIN <= MAX <= 10,000,000"),
    (["--input-len", "3-"], "--input-len must be N or MIN-MAX"),  # was taken as 3
    (["--rates", ""], "rates must be positive numbers, got ''"),  # was a run at --rate 1
    (["--seed", "-1"], "--seed must be >= 0, got -1"),  # was numpy's traceback
])
def test_non_finite_or_absurd_options_are_refused_before_any_request(flags, needle, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--url", "http://127.0.0.1:1/v1", *flags])  # never reached: the check comes first
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err


def test_the_attainment_plot_draws_rates_in_order_whatever_the_sweep_order(tmp_path, monkeypatch):
    import matplotlib.axes

    from mooncake.bench.report import write_plots

    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, *a, **k: (drawn.append(list(x)), plot(self, x, *a, **k))[1])
    runs = [(summarize([RequestRecord(0, 10, 4, 0.0)], rate, 1.0, 1.0), []) for rate in (4.0, 1.0, 2.0, math.inf)]
    write_plots(tmp_path, runs, 1.0, 0.9)
    assert drawn == [[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]]


def test_a_run_s_prompts_are_built_when_their_requests_are_due(monkeypatch):
    from mooncake.bench import cli

    built = []
    real = workload.prompt_of
    monkeypatch.setattr(workload, "prompt_of", lambda spec, **kw: (built.append(spec.index), real(spec, **kw))[1])
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--url", "http://x/v1"])
    specs = workload.generated_specs(1000, (2000, 2000), 4, 0, 0)
    prompts = cli._Prompts(args, specs, 0)
    assert len(prompts) == 1000 and built == []  # a long trace's prompts are not all held at once
    assert len(prompts[7]) == 2000 and built == [7]
    assert prompts[7] == real(specs[7], block_size=args.trace_block_size, vocab_size=args.vocab_size, seed=0, salt=0)


def test_trace_error_is_the_base_class_the_simulator_uses():
    from conductor.sim.trace import TraceError as SimTraceError
    assert SimTraceError is TraceError and issubclass(workload.PromptsFileError, TraceError)


def test_measured_over_predicted_ttft_covers_completed_requests_the_server_predicted():
    records = [rec(0, ttft=0.5), rec(1, ttft=1.0), rec(2, ttft=3.0), rec(3, status=REFUSED), rec(4, ttft=9.0)]
    for r, predicted in zip(records, (1.0, 1.0, 2.0, 1.0, None)):  # the last: a server that said nothing
        r.predicted_ttft_s = predicted
    assert [r.ttft_over_predicted for r in records] == [pytest.approx(0.5), pytest.approx(1.0),
                                                        pytest.approx(1.5), None, None]
    ratio = summarize(records, 1.0, 10.0, 1.0).ttft_over_predicted
    assert ratio == {"n": 3, **percentiles([0.5, 1.0, 1.5], (10, 50, 90))}
    assert summarize([rec(0, ttft=0.5)], 1.0, 1.0, 1.0).ttft_over_predicted == {}


def test_the_predicted_ttft_header_is_read_in_seconds():
    from mooncake.bench.runner import predicted_ttft_s

    assert predicted_ttft_s({"x-mooncake-predicted-ttft-ms": "2500"}) == pytest.approx(2.5)
    assert predicted_ttft_s({"x-mooncake-predicted-ttft-ms": "soon"}) is None
    assert predicted_ttft_s({}) is None and predicted_ttft_s(None) is None


@pytest.mark.parametrize("fraction, shown", [(0.8996, "89.9%"), (0.9, "90.0%"), (0.9999, "99.9%"), (1.0, "100.0%"),
                                             (0.0, "0.0%"), (1 / 3, "33.3%")])
def test_attainment_is_shown_rounded_down_so_a_miss_never_reads_as_the_target(fraction, shown):
    from mooncake.bench.report import percent

    assert percent(fraction) == shown


def test_a_poisson_sweep_of_hours_is_said_before_it_starts(capsys):
    rc = main(["--url", "http://127.0.0.1:1/v1", "--num-requests", "100", "--input-len", "5", "--rate", "0.001"])
    err = capsys.readouterr().err
    assert rc == 1 and "cannot reach" in err  # nothing listens there: stopped at the endpoint check,
    assert "warning: sending 100 requests at each rate takes 28.6 hours in all" in err  # after the warning
