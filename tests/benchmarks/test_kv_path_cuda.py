"""benchmarks/kv_path_cuda.py on host caches (--device cpu), small: the same push, land and
bit-for-bit check it runs on a GPU, so the script keeps working where CI has no GPU. No figure
is judged here (speed is measured by the benchmark itself, on a GPU)."""

import json

from benchmarks import kv_path_cuda


def test_the_benchmark_moves_and_checks_every_configuration(tmp_path, capsys):
    out = tmp_path / "kv.json"
    kv_path_cuda.main(["--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                       "--tokens", "512", "--chunk-tokens", "128", "--repeats", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["transport"], r["layout"]) for r in result["rows"]}
    assert rows == {("tcp", "blocks_first"), ("shm", "blocks_first"), ("tcp", "kv_first"), ("shm", "kv_first")}
    assert all(r["bytes"] == 512 * 2 * 2 * 16 * 2 * 2 and r["push_gbps"] > 0 for r in result["rows"])
    assert not any(r["pinned_arena"] for r in result["rows"])  # no GPU: nothing to pin for
    assert "| tcp | kv_first |" in capsys.readouterr().out
