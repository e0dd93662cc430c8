import socket

import pytest

from conductor.metrics import ConductorMetrics
from messenger.tcp import TcpClient, TcpServer, TransferError, parse_address
from messenger.wire import WireError, decode_prefix, encode_prefix
from mooncake.protocol import PullParams, PushParams, parse_pull, parse_push
from mooncake.launcher import plan_cpu_binding
from mooncake.logs import QuietPollingFilter
from mooncake.protocol import GenerateRequest, Sampling


@pytest.mark.parametrize("cores,count,expected", [
    ([0, 1], 2, ["0", "1"]),
    ([0, 1, 2, 3], 2, ["0-1", "2-3"]),
    ([0, 1, 2], 2, ["0-1", "2"]),
    ([0, 1], 3, ["0", "1", "0"]),
    ([0], 1, ["0"]),
])
def test_cpu_binding_plan(cores, count, expected):
    assert plan_cpu_binding(cores, count) == expected


def test_params_round_trip():
    push = PushParams("t", "10.0.0.2:7000", 123)
    pull = PullParams("t", 123, 9.0)
    assert parse_push(push.to_params()) == push and parse_pull(pull.to_params()) == pull
    assert parse_push(None) is None and parse_pull({}) is None


def test_generate_request_round_trips_through_json():
    import json

    req = GenerateRequest("r1", [1, 2, 3], Sampling(max_tokens=4, stop_token_ids=(7,), logit_bias=((5, -2.5), (9, 1.0))))
    assert GenerateRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req


def test_access_log_leaves_out_polling_routes_only():
    import logging

    def access(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", "GET", path, "1.1", 200), None)

    quiet = QuietPollingFilter()
    assert not quiet.filter(access("/internal/registry/instances/p0/load"))
    assert not quiet.filter(access("/health"))
    assert quiet.filter(access("/v1/completions"))


def test_wire_rejects_foreign_and_oversized_frames():
    with pytest.raises(WireError):
        decode_prefix(b"HTTP" + encode_prefix(b"{}", 0)[4:])
    with pytest.raises(WireError):
        decode_prefix(encode_prefix(b"{}", 1 << 40))


def test_tcp_request_reply_and_errors():
    server = TcpServer("127.0.0.1", 0, lambda h, p: {"ok": True, "n": len(p), "echo": h["x"]}).start()
    client = TcpClient()
    try:
        reply = client.request(server.address, {"x": 5}, b"a" * 100_000)
        assert reply == {"ok": True, "n": 100_000, "echo": 5}
        with pytest.raises(TransferError):
            client.request(server.address, {"y": 1})  # handler raises KeyError -> refused, not hung
    finally:
        server.close()
        client.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(TransferError):
        TcpClient().request(f"127.0.0.1:{free}", {"op": "ping"})
    assert parse_address("[::1]:80") == ("::1", 80)


def test_metrics_text_declares_each_family_once():
    from conductor.metrics import LiveState

    metrics = ConductorMetrics()
    metrics.requests.labels(endpoint="completions", status="200").inc()
    metrics.routes.labels(kind="colocated").inc()
    metrics.ttft.observe(0.3)
    metrics.watch(lambda: LiveState(in_flight=2, ready_workers={"prefill": 2, "decode": 1},
                                    push_bandwidth_Bps={"prefill-0": 1.5e9}))
    text = metrics.render().decode()
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len(set(helps)), helps
    assert 'mooncake_ready_workers{role="decode"} 1.0' in text and 'mooncake_ready_workers{role="prefill"} 2.0' in text
    assert 'mooncake_kv_push_bandwidth_bytes_per_second{instance="prefill-0"} 1.5e+09' in text
    assert "mooncake_in_flight_requests 2.0" in text
    assert 'mooncake_requests_total{endpoint="completions",status="200"} 1.0' in text
    assert 'mooncake_routes_total{kind="colocated"} 1.0' in text
    assert 'mooncake_time_to_first_token_seconds_bucket{le="0.5"} 1.0' in text
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])  # every sample ends in a number


@pytest.mark.parametrize("argv", [["serve"], ["prefill"], ["decode"], ["conductor"], ["sim"], ["profile"]])
def test_help_of_every_command_shows_defaults_but_never_none(argv, capsys):
    from mooncake.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "(default: " in text and "(default: None)" not in text and "(default: False)" not in text


def test_request_schema_sets_unknown_fields_aside_and_names_unsupported_ones():
    from conductor.schemas import ChatCompletionRequest, CompletionRequest

    body = CompletionRequest(model="m", prompt="a", some_future_field=1, best_of=1, logprobs=0,
                             response_format={"type": "text"}, tool_choice="none")
    assert body.unknown_fields() == ["some_future_field"] and body.unsupported_option() is None
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], top_logprobs=3)
    assert chat.unsupported_option()[0] == "top_logprobs"


def test_push_bandwidth_is_averaged_over_intervals_that_moved_enough_bytes():
    from conductor.bandwidth import PushBandwidthMeter

    m = PushBandwidthMeter(min_bytes=1000, weight=0.5)
    assert m.update(0, 0.0) is None  # nothing pushed yet
    assert m.update(500, 0.5) is None  # too few bytes to judge: the interval keeps growing
    assert m.update(2000, 1.0) == 2000.0  # 2000 bytes in 1 s
    assert m.update(6000, 2.0) == 0.5 * 2000.0 + 0.5 * 4000.0
    assert m.update(6000, 2.0) == 3000.0  # no new pushes: unchanged
    assert m.update(100, 0.05) == 3000.0  # counters reset (worker restarted): re-based, kept
    assert m.update(2100, 1.05) == 0.5 * 3000.0 + 0.5 * 2000.0
    late = PushBandwidthMeter(min_bytes=1000)
    assert late.update(10_000, 2.0) == 5000.0  # joined a worker that already pushed: its lifetime mean
