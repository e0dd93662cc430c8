"""The calibration core: a per-instance multiplicative fit of the prior to measured times."""

import math
import random
from dataclasses import replace

import pytest

from conductor.core.calibration import Calibration, CalibrationConfig, ScaleFit
from conductor.core.estimators import DecodeModel, PrefillModel
from tests.core.core_helpers import EST, decode, prefill, request, scheduler, state


def test_converges_to_the_true_scale_from_noisy_samples():
    rng = random.Random(7)
    cal = Calibration(EST).instance("p1")
    for _ in range(200):
        prompt = rng.randrange(100, 4000)
        true = 0.4 * EST.prefill_s(prompt, 0)
        cal.observe_prefill(prompt, 0, true * math.exp(rng.gauss(0, 0.15)))  # ~15% noise
    assert cal.prefill.scale == pytest.approx(0.4, rel=0.08)
    assert cal.prefill.samples == 200 and cal.decode_step.samples == 0
    assert cal.prefill.relative_error < 0.2
    model = cal.prefill_model()  # still a PrefillModel: the prior's coefficients times the scale
    assert isinstance(model, PrefillModel)
    assert model.seconds(1000, 0) == pytest.approx(cal.prefill.scale * EST.prefill_s(1000, 0))


def test_outliers_barely_move_it():
    fit = ScaleFit(CalibrationConfig(prior_weight=0))
    for _ in range(40):
        fit.add(2.0, 1.0)
    for _ in range(8):  # a fifth of the window 10x off
        fit.add(200.0, 1.0)
    assert fit.scale == pytest.approx(2.0)


def test_few_samples_stay_near_the_prior_and_many_reach_the_measurement():
    fit = ScaleFit(CalibrationConfig(prior_weight=4))
    fit.add(3.0, 1.0)  # one sample: log-scale weighted 1/5
    assert fit.scale == pytest.approx(3.0 ** 0.2)
    for _ in range(63):
        fit.add(3.0, 1.0)
    assert fit.scale == pytest.approx(3.0 ** (64 / 68))  # the window holds 64
    assert fit.relative_error == pytest.approx(abs(3.0 - fit.scale) / 3.0)


def test_scale_is_clamped_and_bad_samples_ignored():
    fit = ScaleFit(CalibrationConfig(prior_weight=0, max_scale=10.0))
    assert not fit.add(0.0, 1.0) and not fit.add(1.0, float("nan")) and fit.samples == 0
    assert fit.relative_error is None and fit.scale == 1.0
    fit.add(1000.0, 1.0)
    assert fit.scale == 10.0


def test_instances_are_isolated_and_dropped_when_they_leave():
    cal = Calibration(EST, CalibrationConfig(prior_weight=0))
    cal.instance("slow").observe_decode_step(4, 400, 3 * EST.tbt_s(4, 400))
    assert cal.scales("slow") == (1.0, pytest.approx(3.0))
    assert cal.scales("other") == (1.0, 1.0)  # not measured yet: the better of the prior and the cluster's
    assert isinstance(cal.instance("slow").decode_model(), DecodeModel)
    assert set(cal.describe()) == {"slow"}  # scales() of an unseen instance creates nothing
    cal.instance("other")  # first sight
    assert set(cal.describe()) == {"slow", "other"}
    cal.retain({"other"})
    assert set(cal.describe()) == {"other"} and cal.scales("slow") == (1.0, 1.0)
    cal.instance("fast").observe_decode_step(4, 400, 0.1 * EST.tbt_s(4, 400))
    cal.instance("slow").observe_decode_step(4, 400, 3 * EST.tbt_s(4, 400))
    assert cal.scales("other") == (1.0, pytest.approx((3.0 * 0.1) ** 0.5))  # the cluster's, below 1


def test_a_slow_instance_is_priced_slower_and_loses_the_request():
    sched = scheduler(ttft_slo_s=100.0)
    fast, slow = prefill("p1"), replace(prefill("p2"), prefill_scale=3.0)
    d = scheduler(ttft_slo_s=100.0).schedule(request(1000), state(fast, slow, decode("d1")), 0.0)
    assert d.prefill_instance == "p1" and d.predicted_prefill_s == pytest.approx(EST.prefill_s(1000, 0))
    alone = sched.schedule(request(1000), state(slow, decode("d1")), 0.0)
    assert alone.predicted_prefill_s == pytest.approx(3.0 * EST.prefill_s(1000, 0))
    assert alone.predicted_ttft_s == pytest.approx(3.0 * EST.prefill_s(1000, 0))


def test_a_request_the_prior_refuses_for_ttft_is_admitted_once_the_instance_measures_3x_faster():
    sched = scheduler(ttft_slo_s=1.5)  # prior: 2,000 tokens take 2 s
    cal = Calibration(EST, CalibrationConfig(prior_weight=0))

    def snapshot():
        return state(replace(prefill("p1"), prefill_scale=cal.scales("p1")[0]), decode("d1"))

    refused = sched.schedule(request(2000), snapshot(), 0.0)
    assert refused.reason == "ttft_slo"
    for prompt in (500, 1000, 1500, 2500, 3000):
        cal.instance("p1").observe_prefill(prompt, 0, EST.prefill_s(prompt, 0) / 3)
    admitted = sched.schedule(request(2000), snapshot(), 0.0)
    assert admitted.prefill_instance == "p1" and admitted.predicted_ttft_s == pytest.approx(2.0 / 3)


def test_decode_steps_are_priced_with_the_instance_scale():
    sched = scheduler(tbt_slo_s=0.05)  # prior step at batch 31: 0.01 + 0.031 = 41 ms
    busy = decode("d1", batch=30)
    admitted = sched.schedule(request(100), state(prefill("p1"), busy), 0.0)
    assert admitted.decode_instance == "d1"
    slow = replace(busy, decode_scale=2.0)
    refused = sched.schedule(request(100), state(prefill("p1"), slow), 0.0)
    assert refused.reason == "tbt_slo" and refused.predicted_tbt_s == pytest.approx(2 * admitted.predicted_tbt_s)


def test_an_unmeasured_instance_borrows_the_measured_ones_scale_until_it_has_its_own():
    cal = Calibration(EST, CalibrationConfig(prior_weight=0))
    assert cal.scales("p1") == (1.0, 1.0)  # nothing measured: the prior
    cal.instance("d1").observe_prefill(1000, 0, 0.5 * EST.prefill_s(1000, 0))
    cal.instance("d2").observe_prefill(1000, 0, 0.8 * EST.prefill_s(1000, 0))
    pooled = (0.5 * 0.8) ** 0.5
    # p1 is priced like its measured peers, not at the prior that would make it lose every request.
    assert cal.scales("p1") == (pytest.approx(pooled), 1.0)
    cal.instance("p1")  # seen, still no sample
    assert cal.scales("p1") == (pytest.approx(pooled), 1.0)
    cal.instance("p1").observe_prefill(1000, 0, 2.0 * EST.prefill_s(1000, 0))
    assert cal.scales("p1")[0] == pytest.approx(2.0)  # its own measurement wins
    assert cal.scales("d1") == (pytest.approx(0.5), 1.0)


def test_an_unmeasured_prefill_instance_wins_a_long_prompt_when_the_decode_one_measured_fast():
    """The live failure this guards against: the decode instance prefilled short prompts (conditional
    disaggregation) and measured faster than the prior; the prefill instance, never tried, kept
    the prior's price and so lost long prompts too."""
    sched = scheduler(ttft_slo_s=100.0)
    cal = Calibration(EST, CalibrationConfig(prior_weight=0))
    for prompt in (100, 200, 300):
        cal.instance("d1").observe_prefill(prompt, 0, 0.7 * EST.prefill_s(prompt, 0))
    snapshot = state(replace(prefill("p1"), prefill_scale=cal.scales("p1")[0]),
                     replace(decode("d1"), prefill_scale=cal.scales("d1")[0]))
    assert sched.schedule(request(2000), snapshot, 0.0).prefill_instance == "p1"


def test_cluster_scales_are_the_geometric_mean_of_the_measured_instances():
    from conductor.core.calibration import cluster_scales

    doc = {"profile": "x", "instances": {
        "p1": {"prefill": {"scale": 0.5, "samples": 10}, "decode_step": {"scale": 1.0, "samples": 0}},
        "p2": {"prefill": {"scale": 2.0, "samples": 3}, "decode_step": {"scale": 9.0, "samples": 0}},
        "d1": {"prefill": {"scale": 7.0, "samples": 0}, "decode_step": {"scale": 0.8, "samples": 5}}}}
    prefill, decode = cluster_scales(doc)
    assert prefill == pytest.approx(1.0) and decode == pytest.approx(0.8)  # unmeasured fits are left out
    assert cluster_scales({"instances": {}}) == (1.0, 1.0)
    # The TTFT residual multiplies the prefill scale, as the conductor prices with it.
    doc["instances"]["p1"]["ttft_residual"] = {"scale": 1.5, "samples": 20}
    doc["instances"]["d1"]["ttft_residual"] = {"scale": 0.2, "samples": 0}  # unmeasured: left out
    assert cluster_scales(doc)[0] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="p1"):
        cluster_scales({"instances": {"p1": {"prefill": {"scale": 1.0}}}})
    with pytest.raises(ValueError, match="instances"):
        cluster_scales({"instances": [1, 2]})


def test_a_fitted_profile_gives_the_calibrated_estimators():
    from conductor.core.calibration import InstanceCalibration, fitted_profile
    from conductor.core.estimators import Estimators
    from conductor.core.profile_table import load_profile

    table = load_profile("smollm2-135m-cpu")
    prior = Estimators.from_profile(table)
    fitted = Estimators.from_profile(fitted_profile(table, 0.6, 1.7))
    cal = InstanceCalibration(prior, CalibrationConfig())
    cal.prefill.scale, cal.decode_step.scale = 0.6, 1.7
    for prompt, cached in ((500, 0), (3000, 1024), (8000, 0)):
        assert fitted.prefill_s(prompt, cached) == pytest.approx(cal.prefill_model().seconds(prompt, cached), rel=1e-6)
    for batch, kv in ((1, 1000), (16, 40_000)):
        assert fitted.tbt_s(batch, kv) == pytest.approx(cal.decode_model().step_seconds(batch, kv), rel=1e-6)
    with pytest.raises(ValueError):
        fitted_profile(table, 0.0, 1.0)


def test_the_ttft_residual_fits_measured_over_predicted_ttft_whatever_it_was_priced_with():
    cfg = CalibrationConfig(prior_weight=0)
    cal = Calibration(EST, cfg)
    p1 = cal.instance("p1")
    rng = random.Random(3)
    for _ in range(100):
        # The cluster runs 1.4x slower than the fits say. Each prediction was priced with the
        # residual of its time; measured over the prediction less that residual is the sample,
        # so the fit lands on 1.4 rather than chasing its own corrections.
        base = rng.uniform(1.0, 9.0)
        priced = p1.ttft_residual.scale if p1.ttft_residual.samples else 1.0
        assert p1.observe_ttft(1.4 * base * math.exp(rng.gauss(0, 0.1)), base * priced, priced)
    assert p1.ttft_residual.scale == pytest.approx(1.4, rel=0.05)
    p1.prefill.add(2.0, 1.0)  # a prefill fit of 2 (prior_weight 0)
    assert cal.scales("p1")[0] == pytest.approx(2.0 * p1.ttft_residual.scale)
    assert p1.prefill_model().seconds(1000, 0) == pytest.approx(cal.scales("p1")[0] * EST.prefill_s(1000, 0))
    assert cal.ttft_residual("p1") == p1.ttft_residual.scale
    # An instance with no sample is priced with the cluster's residual only when below 1.
    assert cal.ttft_residual("p2") == 1.0
    assert cal.instance("p3").observe_ttft(0.5, 1.0, 1.0) and cal.ttft_residual("p2") < 1.0


def test_short_predictions_are_not_residual_samples_and_the_residual_is_clamped():
    cfg = CalibrationConfig(prior_weight=0, min_ttft_sample_s=0.25)
    p1 = Calibration(EST, cfg).instance("p1")
    # A 50 ms prediction measured at 200 ms is HTTP and tokenizing, not a slow cluster.
    assert not p1.observe_ttft(0.2, 0.05, 1.0) and p1.ttft_residual.samples == 0
    assert not p1.observe_ttft(1.0, 2.0, 0.0)  # no residual priced: not a sample
    for _ in range(10):
        assert p1.observe_ttft(100.0, 1.0, 1.0)
    assert p1.ttft_residual.scale == cfg.max_residual
    with pytest.raises(ValueError):
        CalibrationConfig(max_residual=0.5)
