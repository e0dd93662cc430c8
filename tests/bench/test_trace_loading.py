"""`mooncake bench` reading Mooncake-format traces: --num-requests stops the reading, and a
malformed line is reported by its number before anything is sent."""

import argparse
import json

from mooncake.bench import cli


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(list(argv))
    assert cli.check(args) == []
    return args


def trace_line(timestamp, input_length=1100, output_length=0, **extra) -> str:
    return json.dumps({"timestamp": timestamp, "input_length": input_length, "output_length": output_length,
                       "hash_ids": [0, 1, 2], **extra})


def test_num_requests_reads_no_further_than_its_count(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(trace_line(1178625) + "\n" + trace_line(1181678, session_id="s") + "\n{broken\n")
    specs = cli.build_specs(bench_args("--trace", str(path), "--num-requests", "2", "--arrival", "trace"))
    assert [s.timestamp_ms for s in specs] == [1178625.0, 1181678.0]
    assert [s.max_tokens for s in specs] == [1, 1]  # output_length 0 is sent as 1 token: a server refuses 0


def test_a_malformed_trace_line_stops_bench_before_sending_naming_the_line(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(trace_line(0) + "\n" + trace_line(5) + "\n" + '{"timestamp": 9, "input_length": 6758.0}\n')
    # the URL is never reached: the trace is read first and its third line is refused
    assert cli.main(["--trace", str(path), "--url", "http://127.0.0.1:9/v1"]) == 2
    assert f"{path}:3: 'input_length' must be an integer, got 6758.0" in capsys.readouterr().err
