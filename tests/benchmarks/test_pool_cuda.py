"""benchmarks/pool_cuda.py on host caches (--device cpu), small: the same save, load and
bit-for-bit check it runs on a GPU, so the script keeps working where CI has no GPU."""

import json

import pytest

from benchmarks import pool_cuda


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first"])
def test_the_benchmark_saves_loads_and_checks(tmp_path, layout):
    out = tmp_path / "pool.json"
    pool_cuda.main(["--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "256",
                    "--repeats", "1", "--layout", layout, "--out", str(out)])
    row = json.loads(out.read_text())["row"]
    assert row["bytes"] == 256 * 2 * 2 * 16 * 2 * 2 and row["save_gbps"] > 0 and row["load_gbps"] > 0
