"""benchmarks/call_latency.py, small: a real call between two processes on its lane and through
each transport, and the socket floor beside them, so the script keeps working. No figure is
judged here."""

from benchmarks import call_latency


def test_the_benchmark_prints_every_row(capsys):
    call_latency.main(["--calls", "30", "--reply-bytes", "0,4096", "--transports", "tcp,shm"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and " B |" in line]
    assert len(rows) == 8 and sum("messenger call, through shm" in r for r in rows) == 2
    assert sum("messenger call, on its lane" in r for r in rows) == 2
