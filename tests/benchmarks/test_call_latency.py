"""benchmarks/call_latency.py, small: a real call between two processes over each transport and
the socket floor beside it, so the script keeps working. No figure is judged here."""

from benchmarks import call_latency


def test_the_benchmark_prints_every_row(capsys):
    call_latency.main(["--calls", "30", "--reply-bytes", "0,4096", "--transports", "tcp,shm"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and " B |" in line]
    assert len(rows) == 6 and sum("messenger call, shm" in r for r in rows) == 2
