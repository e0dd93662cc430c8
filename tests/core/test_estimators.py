import json

import pytest

from conductor.core import Estimators, InstanceState, Role, load_profile, paper_scale_profile
from conductor.core.profile_table import ProfileTable, save_profile


def test_fit_recovers_the_analytic_profile():
    table = paper_scale_profile()
    est = Estimators.from_profile(table)
    for r in table.prefill:
        assert est.prefill_s(r.prompt_tokens, r.cached_tokens) == pytest.approx(r.seconds, rel=0.02)
    for r in table.decode:
        assert est.tbt_s(r.batch_size, r.kv_tokens) == pytest.approx(r.step_seconds, rel=0.02)
    assert est.prefill_s(16384, 8192) < est.prefill_s(16384, 0)  # a cached prefix saves time


def test_transfer_waits_behind_the_senders_queue():
    est = Estimators.from_profile(paper_scale_profile(), transfer_latency_s=0.0)
    idle = InstanceState("p", Role.PREFILL, bandwidth_Bps=1e9)
    busy = InstanceState("p", Role.PREFILL, bandwidth_Bps=1e9, pending_send_bytes=1e9)
    t = est.transfer_s(1000, idle)
    assert t == pytest.approx(1000 * est.kv_bytes_per_token / 1e9)
    assert est.transfer_s(1000, busy) == pytest.approx(t + 1.0)
    assert est.transfer_s(0, busy) == 0.0


def test_bundled_profiles_load_and_roundtrip(tmp_path):
    table = load_profile("paper-70b-8gpu")
    assert table.kv_bytes_per_token == 327_680  # 80 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes
    save_profile(table, tmp_path / "t.json")
    assert load_profile(tmp_path / "t.json") == table
    with pytest.raises(FileNotFoundError):
        load_profile("no-such-profile")


@pytest.mark.parametrize("text", ["", '{"name": "x"}', "[1]", '{"timestamp": 0, "input_length": 5}'])
def test_a_file_that_is_not_a_profile_table_is_named_in_the_error(tmp_path, text):
    path = tmp_path / "wrong.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="wrong.json is not a profile table"):
        load_profile(path)


def test_profile_validation(tmp_path):
    d = paper_scale_profile().to_json()
    d["prefill"] = d["prefill"][:2]
    with pytest.raises(ValueError, match="need >= 4 prefill rows"):
        ProfileTable.from_json(d)
    d = paper_scale_profile().to_json()
    d["prefill"][0]["cached_tokens"] = d["prefill"][0]["prompt_tokens"]
    with pytest.raises(ValueError, match="bad prefill row"):
        ProfileTable.from_json(json.loads(json.dumps(d)))
