"""The live conductor calibrates each instance from what its workers measured.

A real CompletionService, Router and Relay; a fake worker client answers like the workers do,
with measured times on each request's last chunk. Also: the /metrics gauges, the debug
endpoint, the engine's measured times, and the profile chosen for the cluster's dtype.
"""

import asyncio
import logging
import math
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conductor.app import create_app, estimators_report
from conductor.config import ConductorConfig, resolve_profile
from conductor.core.calibration import Calibration, CalibrationConfig
from conductor.core.profile_table import bundled_profile_exists
from conductor.metrics import LiveState
from conductor.relay import Relay
from conductor.schemas import CompletionRequest
from conductor.serving import CompletionService
from mooncake import defaults
from mooncake.defaults import Dtype
from mooncake.engine.engine import measured_times
from mooncake.protocol import CHUNK_DECODER, GenerateChunk, encode_chunk_line
from tests.spine.test_lifecycle import LetterTokenizer
from tests.spine.test_routing import pool_of, router

PREFILL_S, STEP_S = 0.05, 0.004


class MeasuringClient:
    """Stands in for WorkerClient: 8 tokens per request, the last chunk carrying the measured
    prefill time (times `slow` on the named instances) and decode step."""

    def __init__(self, slow: dict[str, float] | None = None, concurrent: int = 0, loaded: int = 0):
        self.slow = slow or {}
        self.concurrent = concurrent  # other prompts each prefill shared the engine with
        self.loaded = loaded  # prompt tokens each prefill loaded from a KVCache pool

    async def generate(self, handle, request):
        n = request.sampling.max_tokens
        k = self.slow.get(handle.name, 1.0)
        yield GenerateChunk([1], num_cached_tokens=0)
        await asyncio.sleep(0)
        times = {"prefill_s": PREFILL_S * k, "queued_s": 0.001, "prefill_concurrent": self.concurrent,
                 "prefill_loaded_tokens": self.loaded or None}
        if n >= 2:
            times.update(decode_step_s=STEP_S * k, decode_concurrent=self.concurrent)
        yield GenerateChunk([2] * (n - 1), finish_reason="length", **times)

    async def drop_transfer(self, handle, transfer_id):
        pass


def service_for(specs, client, calibration: CalibrationConfig | None = None):
    pool = pool_of(*specs)
    r = router(pool)
    if calibration is not None:
        r.calibration = Calibration(r.scheduler.estimators, calibration)
    relay = Relay(client, 1.0, pick_fallback=lambda tried: None)
    return CompletionService(ConductorConfig(model_path="unused", served_model_name="m"), LetterTokenizer(),
                             r, relay, r.metrics)


async def complete(service, prompt_tokens: int, max_tokens: int = 8, first_token: int = 0):
    prompt = list(range(first_token, first_token + prompt_tokens))
    prepared = await service.prepare(CompletionRequest(model="m", prompt=prompt, max_tokens=max_tokens))
    return await service.serve(prepared, "completions")


def test_disaggregated_requests_feed_the_prefill_and_the_decode_instance():
    service = service_for((("p1", "prefill"), ("d1", "decode")), MeasuringClient())
    r = service.router
    for _ in range(3):
        assert asyncio.run(complete(service, 2500)).status_code == 200
    p1, d1 = r.calibration.instance("p1"), r.calibration.instance("d1")
    assert (p1.prefill.samples, p1.decode_step.samples) == (3, 0)
    assert (d1.prefill.samples, d1.decode_step.samples) == (0, 3)  # D's own "prefill" only loads KV
    # Measured against the prior for what ran: 2,500 prompt tokens on P; on D one sequence
    # (itself) of 2,500 + 8 tokens, as the ledger prices it.
    expected = (PREFILL_S / r.scheduler.estimators.prefill_s(2500, 0)) ** (3 / 7)  # shrunk: 3/(3+4)
    assert p1.prefill.scale == pytest.approx(expected)
    expected = (STEP_S / r.scheduler.estimators.tbt_s(1, 2508)) ** (3 / 7)
    assert d1.decode_step.scale == pytest.approx(expected)
    # The ledger's queued prefill for the next request is priced with the calibrated scale
    # and the TTFT residual (at its floor: this fake answers in a millisecond, not seconds).
    assert p1.ttft_residual.samples == 3 and p1.ttft_residual.scale == CalibrationConfig().min_residual
    route = r.pick("next", list(range(5000, 7500)), 8, now=0.0)
    assert route.prefill.ledger.prefill_jobs["next"] == pytest.approx(
        p1.prefill.scale * p1.ttft_residual.scale * r.scheduler.estimators.prefill_s(2500, 0))


def test_a_colocated_request_feeds_both_on_the_one_instance():
    service = service_for((("d1", "decode"),), MeasuringClient())
    assert asyncio.run(complete(service, 300)).status_code == 200
    d1 = service.router.calibration.instance("d1")
    assert (d1.prefill.samples, d1.decode_step.samples) == (1, 1)


def test_a_prefill_shared_with_other_prompts_is_not_a_sample():
    # A burst's prompts reach their first token after each other's chunks: that time is the
    # queue's (priced apart), not the hardware's; so are decode steps that carried their chunks.
    client = MeasuringClient({"p1": 50.0}, concurrent=3)
    service = service_for((("p1", "prefill"), ("d1", "decode")), client)
    r = service.router
    for _ in range(3):
        assert asyncio.run(complete(service, 2500)).status_code == 200
    p1 = r.calibration.instance("p1")
    assert p1.prefill.samples == 0 and p1.prefill.scale == 1.0
    assert r.calibration.instance("d1").decode_step.samples == 0  # its steps carried others' chunks
    # Computed alone, the same answers are samples.
    client.concurrent = 0
    assert asyncio.run(complete(service, 2500)).status_code == 200
    assert r.calibration.instance("p1").prefill.samples == 1 == r.calibration.instance("d1").decode_step.samples
    # A prefill that shared its first and last steps with its neighbours in a first-come-first-
    # served stream (2 others) still is; a decode step that carried any prompt's chunk is not.
    client.concurrent = 2
    assert asyncio.run(complete(service, 2500)).status_code == 200
    assert r.calibration.instance("p1").prefill.samples == 2
    assert r.calibration.instance("d1").decode_step.samples == 1


@pytest.mark.parametrize("specs", [(("p1", "prefill"), ("d1", "decode")), (("d1", "decode"),)],
                         ids=["disaggregated", "colocated"])
def test_a_prefill_that_loaded_from_a_kvcache_pool_is_not_a_sample_of_compute(specs):
    # Its time includes the load (priced apart, by tier): a fit on it would learn a slow host.
    client = MeasuringClient({"p1": 20.0, "d1": 20.0}, loaded=1024)
    service = service_for(specs, client)
    computed_on = service.router.calibration.instance(specs[0][0])
    for _ in range(2):
        assert asyncio.run(complete(service, 2500)).status_code == 200
    assert computed_on.prefill.samples == 0 and computed_on.prefill.scale == 1.0
    client.loaded = 0  # computed whole: a sample
    assert asyncio.run(complete(service, 2500)).status_code == 200
    assert computed_on.prefill.samples == 1 and computed_on.prefill.scale != 1.0


# This fake answers in a millisecond whatever prefill time it reports, so here the TTFT residual
# (which would learn that every prediction is far too long) is off: the prefill fit alone.
NO_RESIDUAL = CalibrationConfig(min_ttft_sample_s=math.inf)


def test_a_slow_instance_is_calibrated_apart_then_avoided_and_forgotten_when_it_leaves():
    service = service_for((("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")), MeasuringClient({"p1": 500.0}),
                          NO_RESIDUAL)
    r = service.router
    used = []
    for k in range(8):  # distinct prompts: no prefix cache draws them anywhere
        response = asyncio.run(complete(service, 2000, first_token=5_000 * k))
        used.append(response.headers["x-mooncake-prefill"])
    # Idle queues tie and p1 comes first; its measured 25 s (the prior says 6 s) make it the
    # slower one, and the rest go to p2 (measured fast, so cheaper still).
    assert used == ["p1"] + ["p2"] * 7
    assert r.calibration.scales("p1")[0] > 1 > r.calibration.scales("p2")[0]
    r.pool.remove("http://p1")
    assert set(estimators_report(r)) == {"p2", "d1"}


def test_metrics_show_the_estimator_gauges_per_instance():
    service = service_for((("p1", "prefill"), ("d1", "decode")), MeasuringClient())
    r = service.router
    asyncio.run(complete(service, 2500))
    r.metrics.watch(lambda: LiveState(estimators=estimators_report(r)))
    families = {f.name: f for f in text_string_to_metric_families(r.metrics.render().decode())}
    by_name = {(f, tuple(sorted(s.labels.items()))): s.value for f, fam in families.items() for s in fam.samples}
    p1 = r.calibration.instance("p1")
    assert by_name[("mooncake_estimator_prefill_scale", (("instance", "p1"),))] == p1.prefill.scale
    assert by_name[("mooncake_estimator_ttft_residual", (("instance", "p1"),))] == p1.ttft_residual.scale
    assert p1.prefill.scale * p1.ttft_residual.scale == r.calibration.scales("p1")[0]
    assert by_name[("mooncake_estimator_decode_step_scale", (("instance", "d1"),))] == r.calibration.scales("d1")[1]
    assert ("mooncake_estimator_prefill_relative_error", (("instance", "p1"),)) in by_name
    assert ("mooncake_estimator_decode_step_relative_error", (("instance", "d1"),)) in by_name
    assert ("mooncake_estimator_decode_step_relative_error", (("instance", "p1"),)) not in by_name  # no sample
    assert by_name[("mooncake_estimator_samples", (("instance", "p1"), ("kind", "prefill")))] == 1
    assert by_name[("mooncake_estimator_samples", (("instance", "p1"), ("kind", "decode_step")))] == 0
    assert by_name[("mooncake_estimator_samples", (("instance", "d1"), ("kind", "decode_step")))] == 1


def test_debug_endpoint_shows_prior_and_calibrated_coefficients():
    service = service_for((("p1", "prefill"), ("d1", "decode")), MeasuringClient())
    r = service.router
    asyncio.run(complete(service, 2500))
    app = create_app(ConductorConfig(model_path="unused", served_model_name="m"))
    app.state.router, app.state.profile = r, "smollm2-135m-cpu"  # what the lifespan sets
    body = TestClient(app).get("/internal/debug/estimators").json()  # no `with`: no lifespan
    assert body["profile"] == "smollm2-135m-cpu" and set(body["instances"]) == {"p1", "d1"}
    p1 = body["instances"]["p1"]["prefill"]
    residual = body["instances"]["p1"]["ttft_residual"]
    assert p1["samples"] == 1 == residual["samples"]
    assert p1["scale"] * residual["scale"] == r.calibration.scales("p1")[0]
    # The calibrated coefficients are the ones it is priced with: the residual included.
    assert p1["calibrated"]["c1"] == pytest.approx(p1["prior"]["c1"] * p1["scale"] * residual["scale"])
    assert p1["relative_error"] >= 0
    d1 = body["instances"]["d1"]["decode_step"]
    assert d1["samples"] == 1 and d1["calibrated"]["d0"] == pytest.approx(d1["prior"]["d0"] * d1["scale"])


def test_engine_reports_measured_times_from_vllm_request_stats():
    stats = SimpleNamespace(queued_ts=10.0, scheduled_ts=10.5, first_token_ts=11.25, last_token_ts=12.25,
                            num_generation_tokens=5)
    assert measured_times(stats) == {"queued_s": 0.5, "prefill_s": 0.75, "decode_step_s": 0.25}
    one = SimpleNamespace(queued_ts=1.0, scheduled_ts=1.0, first_token_ts=1.5, last_token_ts=1.5,
                          num_generation_tokens=1)
    assert measured_times(one) == {"queued_s": 0.0, "prefill_s": 0.5}  # a prefill request: no step
    assert measured_times(None) == {}  # stats off: nothing claimed
    line = encode_chunk_line(GenerateChunk([1], finish_reason="length", **measured_times(stats)))
    assert CHUNK_DECODER.decode(line).decode_step_s == 0.25
    assert b"prefill_s" not in encode_chunk_line(GenerateChunk([1]))  # omitted when None


def test_the_profile_follows_the_dtype_and_falls_back_to_float32(caplog):
    assert resolve_profile(None, Dtype.FLOAT32) == defaults.PROFILE
    assert resolve_profile("paper-70b-8gpu", Dtype.BFLOAT16) == "paper-70b-8gpu"  # given: used as is
    bf16 = defaults.profile_name(defaults.PROFILE, Dtype.BFLOAT16)
    assert bf16 == "smollm2-135m-cpu-bf16"
    with caplog.at_level(logging.WARNING, logger="conductor.config"):
        chosen = resolve_profile(None, Dtype.BFLOAT16)
    if bundled_profile_exists(bf16):
        assert chosen == bf16
    else:
        assert chosen == defaults.PROFILE and bf16 in caplog.text and "mooncake profile --dtype bfloat16" in caplog.text


def test_the_profile_follows_the_dtype_when_a_table_is_bundled(monkeypatch):
    monkeypatch.setattr("conductor.config.bundled_profile_exists", lambda name: True)
    assert resolve_profile(None, Dtype.BFLOAT16) == "smollm2-135m-cpu-bf16"


def test_profile_command_measures_in_a_dtype_and_names_the_table_for_it():
    from pathlib import Path

    from conductor.profile.cli import build_parser, table_name
    from mooncake.model_fit import DTYPE_BYTES

    args = build_parser().parse_args(["--model", "/m/SmolLM2-135M", "--dtype", "bfloat16"])
    assert args.dtype == "bfloat16" and DTYPE_BYTES[Dtype(args.dtype)] == 2
    assert table_name(Path("/m/SmolLM2-135M"), Dtype.BFLOAT16) == "smollm2-135m-cpu-bf16"
    assert table_name(Path("/m/SmolLM2-135M"), Dtype.FLOAT32) == defaults.PROFILE  # the bundled one's name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--dtype", "int8"])
