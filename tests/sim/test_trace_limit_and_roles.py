"""`mooncake sim --limit` reads no further than its limit; --no-flexible-roles is accepted; the
quirks of the released Mooncake traces (and of copies cut from them) replay without a warning."""

import json

import pytest

from conductor.sim.cli import build_parser, main
from mooncake.trace import TraceError, load_trace


def trace_line(timestamp, input_length=1024, output_length=4, hash_ids=(0, 1), **extra) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": list(hash_ids), **extra})


def test_load_trace_with_a_limit_stops_before_the_lines_after_it(tmp_path):
    # The broken third line stands for the rest of a huge file: a limit of 2 must never reach it.
    path = tmp_path / "t.jsonl"
    path.write_text(trace_line(0) + "\n\n" + trace_line(5) + "\n{broken\n" + trace_line(9) + "\n")
    records = load_trace(path, limit=2)
    assert [r.timestamp_ms for r in records] == [0.0, 5.0]
    assert [r.line for r in records] == [1, 3]  # a blank line is skipped, not counted as a record
    with pytest.raises(TraceError, match=":4: "):
        load_trace(path)  # without a limit the broken line is still an error naming it
    with pytest.raises(ValueError, match="positive"):
        load_trace(path, limit=0)


def test_sim_limit_replays_the_first_lines_without_reading_the_rest(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    # the fourth line, past the limit, is not even UTF-8
    path.write_bytes(f"{trace_line(0)}\n{trace_line(5)}\n{trace_line(9)}\n".encode() + b"\xff\xfe\n")
    assert main(["--trace", str(path), "--limit", "3", "--json", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["requests"] == 3 and out.err == ""


def test_sim_limit_must_be_positive(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(trace_line(0) + "\n")
    assert main(["--trace", str(path), "--limit", "0", "--json", "--no-progress"]) == 2
    assert "--limit must be positive" in capsys.readouterr().err


def test_no_flexible_roles_states_the_fixed_roles_explicitly(tmp_path, capsys):
    assert build_parser().parse_args(["--trace", "x"]).flexible_roles is False
    assert build_parser().parse_args(["--trace", "x", "--flexible-roles"]).flexible_roles is True
    assert build_parser().parse_args(["--trace", "x", "--flexible-roles", "--no-flexible-roles"]).flexible_roles is False
    path = tmp_path / "t.jsonl"
    path.write_text(trace_line(0) + "\n" + trace_line(5) + "\n")
    assert main(["--trace", str(path), "--no-flexible-roles", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 2


def test_the_released_traces_quirks_replay_without_a_warning(tmp_path, capsys):
    """As in the FAST'25 and arXiv traces: many lines share a timestamp, input lengths are not
    multiples of the 512-token block, a very short answer (3 tokens); as in copies cut from them, the
    first timestamp is not 0; as in converted traces, extra keys and lines without hash_ids."""
    lines = [trace_line(1178625, 2105, 650, [0, 70875, 70876, 77598, 77599]),
             trace_line(1178625, 6264, 3, list(range(46, 58)) + [77614]),
             trace_line(1178625, 901, 263, [0, 77613], session_id="s1", turn=2),
             trace_line(1181678, 1059, 523, [0, 77624, 77625]),
             json.dumps({"timestamp": 1181678, "input_length": 700, "output_length": 0})]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["--trace", str(path), "--json", "--no-progress"]) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert out.err == ""
    assert summary["requests"] == 5 and 0.0 <= summary["slo_attainment"] <= 1.0
    # the replay starts at the first arrival, not 1178 s of idle cluster before it
    assert summary["makespan_s"] < 60
