"""Per-request priority and SLOs at the conductor's edge: options, parsing, the operator's bounds,
and a request through the real CompletionService and Router (the real core) with a scripted relay."""

import asyncio

import pytest

from conductor.cli_args import scheduler_config, slo_bounds
from conductor.config import ConductorConfig
from conductor.core.config import SLOClass
from conductor.errors import APIError
from conductor.schemas import CompletionRequest
from conductor.serving import CompletionService
from conductor.slo import RequestSLO, SLOBounds, SLOError, SLOPolicy, parse_range, parse_slo_class
from mooncake.cli import build_parser, main
from tests.spine.test_lifecycle import PROMPT, LetterTokenizer, ScriptedRelay
from tests.spine.test_routing import pool_of, router

BATCH = SLOClass("batch", ttft_slo_s=120.0, tbt_slo_s=2.0, priority=5)
POLICY = SLOPolicy({"default": SLOClass("default", 30.0, 0.5, 0), "batch": BATCH},
                   SLOBounds(ttft_s=(0.1, 30.0), tbt_s=(0.5, 10.0), priority=(0, 100)))


def test_slo_class_option_parses_and_says_what_is_wrong():
    assert parse_slo_class("interactive:2000:150:-1") == SLOClass("interactive", 2.0, 0.15, -1)
    for spec, needle in [("x:1:2", "NAME:TTFT_MS:TBT_MS:PRIORITY"), (":1:2:3", "NAME"),
                         ("x:fast:2:3", "could not convert"), ("x:1:2:high", "invalid literal"),
                         ("x:0:2:3", "ttft_slo_s must be a positive"), ("default:1:2:0", "--ttft-slo")]:
        with pytest.raises(ValueError, match=needle):
            parse_slo_class(spec)
    assert parse_range("100:2000", float, "--r") == (100.0, 2000.0)
    with pytest.raises(ValueError, match="--r wants MIN:MAX"):
        parse_range("100", float, "--r")


def test_options_build_the_classes_and_bounds_and_bad_ones_stop_the_command(capsys):
    args = build_parser().parse_args(["conductor", "--slo-class", "batch:120000:2000:5", "--ttft-slo", "60",
                                      "--priority-headroom", "0.3"])
    cfg = scheduler_config(args)
    assert cfg.slo_classes == (BATCH,) and cfg.priority_headroom == 0.3
    # By default a request may tighten its TTFT SLO below the default class's and loosen its TBT.
    assert slo_bounds(args) == SLOBounds(ttft_s=(0.1, 60.0), tbt_s=(0.5, 10.0), priority=(0, 100))
    # Whatever the default class's SLOs are, the default bounds hold them.
    args = build_parser().parse_args(["conductor", "--ttft-slo", "0.05", "--tbt-slo", "20"])
    assert slo_bounds(args) == SLOBounds(ttft_s=(0.05, 0.05), tbt_s=(20.0, 20.0), priority=(0, 100))
    args = build_parser().parse_args(["serve", "--slo-ttft-range", "50:90000", "--priority-range=-5:5"])
    assert slo_bounds(args) == SLOBounds(ttft_s=(0.05, 90.0), tbt_s=(0.5, 10.0), priority=(-5, 5))
    for argv, needle in [(["--slo-class", "x:1:2"], "NAME:TTFT_MS"), (["--priority-range", "5:1"], "priority bounds"),
                         (["--slo-tbt-range", "500"], "--slo-tbt-range wants MIN:MAX"),
                         (["--priority-headroom", "1"], "priority_headroom"),
                         (["--slo-class", "a:1:1:0", "--slo-class", "a:2:2:0"], "unique")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["conductor", *argv])  # stops before loading a model or binding a port
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_resolve_takes_the_class_then_the_requests_own_values_within_bounds():
    assert POLICY.resolve({}) == RequestSLO("default", 0, 30.0, 0.5)
    assert POLICY.resolve({"X-Mooncake-SLO-Class": "batch"}) == RequestSLO("batch", 5, 120.0, 2.0)
    own = POLICY.resolve({"X-Mooncake-SLO-TTFT-Ms": "1500", "X-Mooncake-Priority": "3"}, tbt_ms=800.0)
    assert own == RequestSLO("default", 3, 1.5, 0.8)
    # The same value in the body and a header is fine; the body's priority alone too.
    assert POLICY.resolve({"X-Mooncake-Priority": "3"}, priority=3).priority == 3
    assert POLICY.resolve({}, priority=7, ttft_ms=200.0) == RequestSLO("default", 7, 0.2, 0.5)


@pytest.mark.parametrize("headers, body, param, code", [
    ({"X-Mooncake-SLO-Class": "gold"}, {}, "X-Mooncake-SLO-Class", "unknown_slo_class"),
    ({"X-Mooncake-SLO-TTFT-Ms": "50"}, {}, "X-Mooncake-SLO-TTFT-Ms", "slo_out_of_bounds"),
    ({"X-Mooncake-SLO-TTFT-Ms": "60000"}, {}, "X-Mooncake-SLO-TTFT-Ms", "slo_out_of_bounds"),
    ({}, {"tbt_ms": 100.0}, "mooncake_slo.tbt_ms", "slo_out_of_bounds"),
    ({"X-Mooncake-SLO-TBT-Ms": "fast"}, {}, "X-Mooncake-SLO-TBT-Ms", "invalid_value"),
    ({"X-Mooncake-SLO-TBT-Ms": "nan"}, {}, "X-Mooncake-SLO-TBT-Ms", "invalid_value"),
    ({"X-Mooncake-Priority": "1.5"}, {}, "X-Mooncake-Priority", "invalid_value"),
    ({}, {"priority": -1}, "priority", "priority_out_of_bounds"),
    ({"X-Mooncake-Priority": "101"}, {}, "X-Mooncake-Priority", "priority_out_of_bounds"),
    ({"X-Mooncake-Priority": "2"}, {"priority": 3}, "priority", "conflicting_values"),
    ({"X-Mooncake-SLO-TTFT-Ms": "900"}, {"ttft_ms": 1000.0}, "mooncake_slo.ttft_ms", "conflicting_values"),
])
def test_out_of_bounds_malformed_or_conflicting_values_name_the_field(headers, body, param, code):
    with pytest.raises(SLOError) as info:
        POLICY.resolve(headers, **body)
    assert (info.value.param, info.value.code) == (param, code)
    assert POLICY.label(headers) == ("unknown" if code == "unknown_slo_class" else "default")


def make_service(**cfg):
    r = router(pool_of(("p1", "prefill"), ("d1", "decode")), **cfg)
    config = ConductorConfig(model_path="unused", served_model_name="m")
    return CompletionService(config, LetterTokenizer(), r, ScriptedRelay(list(range(3))), r.metrics)


def test_a_request_with_a_ttft_slo_it_cannot_meet_is_refused_while_its_class_is_served():
    """PROMPT's prefill is priced at hundreds of ms by the bundled profile: a 100 ms TTFT SLO
    of its own cannot be met, the default class's (60 s here) can. Both counted by class."""
    async def main():
        service = make_service(slo_classes=(BATCH,))
        tight = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=3),
                                      {"X-Mooncake-SLO-TTFT-Ms": "100", "X-Mooncake-SLO-Class": "batch"})
        with pytest.raises(APIError) as info:
            await service.serve(tight, "completions")
        assert info.value.status == 429 and info.value.code == "ttft_slo"
        assert "within 0.10 s" in info.value.message and "class batch, priority 5" in info.value.message
        served = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=3),
                                       {"X-Mooncake-SLO-Class": "batch"})
        response = await service.serve(served, "completions")
        assert response.status_code == 200 and response.headers["x-mooncake-slo-class"] == "batch"
        m = service.metrics
        assert m.value("mooncake_rejections_total", reason="ttft_slo", slo_class="batch") == 1
        assert m.value("mooncake_requests_total", endpoint="completions", status="429", slo_class="batch") == 1
        assert m.value("mooncake_requests_total", endpoint="completions", status="200", slo_class="batch") == 1
        assert m.value("mooncake_time_to_first_token_seconds_count", slo_class="batch") == 1
        assert m.value("mooncake_time_between_tokens_seconds_count", slo_class="batch") == 2
        assert m.value("mooncake_request_latency_seconds_count", slo_class="batch") == 1
        assert m.value("mooncake_request_latency_seconds_count", slo_class="default") == 0
        with pytest.raises(APIError) as info:  # out of bounds: 400 naming the body field
            await service.prepare(CompletionRequest(model="m", prompt=PROMPT, priority=1000))
        assert (info.value.status, info.value.param) == (400, "priority")

    asyncio.run(main())


def test_the_ledger_carries_each_requests_tbt_slo_into_its_decode_batch():
    r = router(pool_of(("p1", "prefill"), ("d1", "decode")))
    route = r.pick("a", PROMPT, 4, now=0.0, slo=RequestSLO("batch", 5, 120.0, 2.0))
    decode = route.decode.ledger
    assert [s.tbt_slo_s for s in decode.incoming.values()] == [2.0]
    r.first_token(route, now=1.0)
    assert [s.tbt_slo_s for s in decode.running.values()] == [2.0]
    state = r._instance(route.decode, 1.0)
    assert state.tightest_tbt_slo_s == 2.0 and not state.any_config_tbt_slo
