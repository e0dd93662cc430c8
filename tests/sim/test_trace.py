import json

import pytest

from conductor.sim.cli import main
from conductor.sim.trace import (TraceError, TraceParams, block_count_mismatches, fitting_block_sizes, generate_trace,
                                  load_trace, write_trace)

GOOD = '{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]}'


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1}', "timestamp"),
    ('{"timestamp": 0, "input_length": "5", "output_length": 1}', "input_length"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}', "hash_ids"),
])
def test_malformed_line_is_reported_with_its_line_number(tmp_path, bad, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n\n" + bad + "\n" + GOOD + "\n")
    with pytest.raises(TraceError, match=msg) as exc:
        load_trace(p)
    assert exc.value.line == 3 and f"{p}:3:" in str(exc.value)


def test_cli_reports_bad_line_and_exits_2(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text(GOOD + "\n" + "{oops\n")
    assert main(["--trace", str(p), "--json"]) == 2
    assert f"{p}:2:" in capsys.readouterr().err


def test_generator_shares_prefixes_and_is_reproducible(tmp_path):
    params = TraceParams(n_requests=300, rate_rps=2.0, n_prefixes=5, seed=1)
    rows = generate_trace(params)
    assert rows == generate_trace(params)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    first_ids = [r["hash_ids"][0] for r in rows]
    assert len(set(first_ids)) <= 5  # every prompt starts with one of the shared prefixes
    write_trace(rows, tmp_path / "g.jsonl", params)
    loaded = load_trace(tmp_path / "g.jsonl")
    assert len(loaded) == 300 and loaded[0].hash_ids == tuple(rows[0]["hash_ids"])
    assert json.loads((tmp_path / "g.jsonl.params.json").read_text())["seed"] == 1


def test_rate_swing_makes_busy_and_quiet_phases_with_the_same_mean_rate():
    flat = TraceParams(n_requests=3000, rate_rps=5.0, seed=3)
    swing = TraceParams(n_requests=3000, rate_rps=5.0, seed=3, rate_amplitude=0.8, rate_period_s=200.0)
    t_flat = [r["timestamp"] / 1000 for r in generate_trace(flat)]
    t_swing = [r["timestamp"] / 1000 for r in generate_trace(swing)]
    assert t_swing == sorted(t_swing)
    busy = sum(1 for t in t_swing if t % 200 < 100)  # rate above the mean in the first half period
    assert busy > 2 * (len(t_swing) - busy)
    assert abs(t_swing[-1] - t_flat[-1]) / t_flat[-1] < 0.15  # about the same span: the mean rate holds
    with pytest.raises(ValueError):
        TraceParams(rate_amplitude=1.0)


def test_undecodable_line_is_reported_with_its_line_number(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b"\xff\xfe garbage\n")
    with pytest.raises(TraceError, match="not UTF-8") as exc:
        load_trace(p)
    assert exc.value.line == 2


def test_byte_order_mark_on_the_first_line_is_accepted(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\n" + GOOD + "\n").encode())
    assert len(load_trace(p)) == 2
    p.write_bytes((GOOD + "\n").encode() + b"\xef\xbb\xbf" + GOOD.encode())  # only a first line may carry one
    with pytest.raises(TraceError) as exc:
        load_trace(p)
    assert exc.value.line == 2


def test_hash_ids_written_with_another_block_size_are_flagged_with_the_size_that_fits(tmp_path, capsys):
    rows = [{"timestamp": i, "input_length": 1000 + 37 * i, "output_length": 3,
             "hash_ids": list(range(-(-(1000 + 37 * i) // 64)))} for i in range(6)]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_trace(p)
    assert len(block_count_mismatches(records, 512)) == 6 and not block_count_mismatches(records, 64)
    assert fitting_block_sizes(records) == [64]
    assert main(["--trace", str(p), "--json", "--no-progress"]) == 0
    assert "--block-size 64 fits every line" in capsys.readouterr().err
    assert main(["--trace", str(p), "--json", "--no-progress", "--block-size", "64"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_absurd_lengths_and_timestamps_are_errors_naming_the_line(tmp_path):
    from mooncake.trace import load_trace

    for bad in ({"input_length": 10**30}, {"output_length": 10**12}, {"timestamp": 1e300}):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n"
                        + json.dumps({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1], **bad})
                        + "\n")
        with pytest.raises(TraceError, match=":2: "):
            load_trace(path)


@pytest.mark.parametrize("line, msg", [
    # an integer past any float: math.isfinite raised OverflowError
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 10, "output_length": 1}', "'timestamp' must be a number"),
    # past Python's 4300-digit limit on integer literals: json.loads raised ValueError
    ('{"timestamp": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 1}', "more than 4300 digits"),
    # past the parser's recursion limit: json.loads raised RecursionError
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "nested too deeply"),
])
def test_a_line_python_cannot_read_is_an_error_naming_the_line(tmp_path, line, msg):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    # the 400-digit value is cut in the message, not quoted whole
    assert str(exc.value).startswith(f"{path}:2: ") and msg in str(exc.value) and len(str(exc.value)) < 200


def test_sim_cli_reports_an_unreadable_line_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n" + '{"timestamp": 0, "input_length": 1' + "0" * 5000 + "}\n")
    assert main(["--trace", str(path), "--json", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: holds a number of more than 4300 digits" in err and "Traceback" not in err
