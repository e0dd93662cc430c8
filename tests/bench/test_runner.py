"""The bench's shell against a fake OpenAI server (FastAPI + uvicorn in a thread, real sockets):
timing capture, Retry-After, errors mid-run, and a down endpoint."""

import asyncio
import json
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from mooncake.bench.cli import main
from tests.http_server import served
from tests.processes import free_port

FIRST_TOKEN_S, GAP_S, TOKENS, RETRY_AFTER_S, CONTEXT = 0.3, 0.1, 4, 1, 4096


def fake_app() -> FastAPI:
    app = FastAPI()
    app.state.bodies, app.state.refused = [], set()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0, "owned_by": "t",
                                            "max_model_len": CONTEXT}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if body["prompt"] == "limit" and "limit" not in app.state.refused:  # refused once, then served
            app.state.refused.add("limit")
            return JSONResponse({"error": {"message": "busy"}}, status_code=429,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body["prompt"] == "draining":  # a 503 that says when to come back: a refusal, as a 429
            return JSONResponse({"error": {"message": "no decode worker ready"}}, status_code=503,
                                headers={"Retry-After": "5"})
        mode = body["prompt"] if isinstance(body["prompt"], str) else "token ids"
        if "retry-after:" in mode:  # refused every time, with that Retry-After
            if mode.startswith("slow-"):
                await asyncio.sleep(0.2)
            return JSONResponse({"error": {"message": "busy"}}, status_code=429,
                                headers={"Retry-After": mode.partition("retry-after:")[2]})
        # "short": stops early by its usage count; "no-usage": sends none; "vllm-error": vLLM's
        # mid-stream error shape after one token; "cut": the connection ends after two tokens;
        # "done-early": [DONE] after two tokens, with no finish_reason
        texts = {"short": 2, "vllm-error": 1, "cut": 2, "done-early": 2}.get(mode, TOKENS)
        unfinished = mode in ("vllm-error", "cut", "done-early")

        async def stream():
            def event(obj):
                return f"data: {json.dumps(obj)}\n\n"
            base = {"id": "c", "object": "text_completion", "created": 0, "model": "fake"}
            await asyncio.sleep(FIRST_TOKEN_S)
            for k in range(texts):
                if k:
                    await asyncio.sleep(GAP_S)
                finish = None if unfinished or k < texts - 1 else "stop" if mode == "short" else "length"
                text = "" if mode == "empty-first" and k == 0 else "x"  # a token that ends mid-character
                yield event(base | {"choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]})
            if mode == "cut":
                raise RuntimeError("the server went away mid-answer")
            if mode == "done-early":
                yield "data: [DONE]\n\n"
                return
            if mode == "vllm-error":
                yield event({"object": "error", "message": "engine died", "type": "InternalServerError", "code": 500})
            elif mode != "no-usage":
                yield event(base | {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": texts,
                                                               "total_tokens": texts + 1}})
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture
def server():
    app = fake_app()
    with served(app) as url:
        yield app, url + "/v1"


def run(tmp_path, url, *extra, prompts_sent=("ok", "limit", "fail")):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": TOKENS}) + "\n" for p in prompts_sent))
    out = tmp_path / "r.json"
    rc = main(["--url", url, "--prompts-file", str(prompts), "--rate", "100", "--out", str(out), *extra])
    return rc, json.loads(out.read_text()) if out.exists() else None


def by_index(doc):
    return {r["index"]: r for r in doc["runs"][0]["requests"]}


def test_timings_retry_after_and_errors_are_captured(server, tmp_path):
    app, url = server
    rc, doc = run(tmp_path, url, "--retry-after", "--ttft-slo", "1.0", "--tbt-slo", "1.0")
    assert rc == 0
    ok, limited, failed = (by_index(doc)[i] for i in range(3))
    assert ok["status"] == "ok" and ok["tokens"] == TOKENS and ok["attempts"] == 1
    # The server sleeps set the scale. Bounds are wide on both sides: on a loaded machine a
    # delayed first chunk shortens the mean gap as much as a delayed later one stretches it.
    assert FIRST_TOKEN_S * 0.9 <= ok["ttft_s"] < FIRST_TOKEN_S + 2.0
    assert GAP_S * 0.5 <= ok["mean_tbt_s"] < GAP_S + 1.0
    assert len(ok["chunk_s"]) == TOKENS and ok["first_token_s"] == ok["chunk_s"][0]
    # served after waiting Retry-After; its latency counts from the first attempt
    assert limited["status"] == "ok" and limited["attempts"] == 2
    assert limited["ttft_s"] >= RETRY_AFTER_S + FIRST_TOKEN_S
    # a failure is an error with its message, never a zero latency
    assert failed["status"] == "error" and "500" in failed["error"] and failed["ttft_s"] is None
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["refused"], s["errors"]) == (2, 0, 1)
    assert s["attainment"] == pytest.approx(1 / 3)  # the retried request misses the 1 s TTFT SLO
    assert s["ttft_s"]["p50"] >= FIRST_TOKEN_S
    # what went on the wire: streaming with usage, greedy, exact lengths
    body = app.state.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == TOKENS


def test_without_retry_after_a_429_is_a_refusal_and_a_miss(server, tmp_path, capsys):
    _, url = server
    rc, doc = run(tmp_path, url, "--no-ignore-eos", prompts_sent=("ok", "limit", "fail", "draining"))
    out = capsys.readouterr().out
    assert "errors at 100 req/s: 1 x HTTP 500" in out  # why, on the console too
    assert "refused at 100 req/s: 1 x Error code: 429 - busy" in out
    assert "refused at 100 req/s: 1 x Error code: 503 - no decode worker ready" in out
    limited, draining = by_index(doc)[1], by_index(doc)[3]
    assert rc == 0 and limited["status"] == "refused" and limited["attempts"] == 1 and limited["ttft_s"] is None
    assert draining["status"] == "refused" and draining["error"] == "Error code: 503 - no decode worker ready"
    s = doc["runs"][0]["summary"]
    assert (s["completed"], s["refused"], s["errors"]) == (1, 2, 1) and s["attainment"] == pytest.approx(1 / 4)


def test_generated_prompts_go_as_token_ids_and_a_sweep_reports_each_rate(server, tmp_path, capsys):
    app, url = server
    out = tmp_path / "r.json"
    rc = main(["--url", url, "--num-requests", "3", "--input-len", "5-8", "--output-len", str(TOKENS),
               "--rates", "50,100", "--warmup", "1", "--out", str(out), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["summary"]["offered_rate"] for r in doc["runs"]] == [50, 100]
    assert all(r["summary"]["attainment"] == 1.0 for r in doc["runs"]) and doc["slo_capacity"] == 100
    assert len(app.state.bodies) == 1 + 3 + 3
    prompts = [b["prompt"] for b in app.state.bodies]
    assert all(isinstance(p, list) and 5 <= len(p) <= 8 and all(isinstance(t, int) for t in p) for p in prompts)
    assert prompts[1:4] != prompts[4:7]  # fresh ids per rate: no run served from another's cache
    assert [len(p) for p in prompts[1:4]] == [len(p) for p in prompts[4:7]]
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 0
    assert (tmp_path / "plots" / "attainment_goodput.png").stat().st_size > 0
    assert "SLO capacity" in capsys.readouterr().out


def test_a_down_endpoint_or_unknown_model_stops_the_run_with_a_clear_message(server, tmp_path, capsys):
    _, url = server
    dead = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["--url", dead, "--num-requests", "1", "--out", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and dead in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()
    assert main(["--url", url, "--model", "other", "--num-requests", "1"]) == 1
    assert "does not serve model 'other'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, needle", [
    (["--out", "/nonexistent-dir/r.json"], "--out"), (["--out", "."], "--out"),
    (["--plot", __file__], "--plot"), (["--request-timeout", "0"], "--request-timeout")])
def test_where_the_results_go_is_checked_before_any_request(flags, needle, capsys):
    """Not after a sweep of many minutes, whose records would then be lost."""
    dead = f"http://127.0.0.1:{free_port()}/v1"  # never reached: the check comes first
    with pytest.raises(SystemExit) as info:
        main(["--url", dead, "--num-requests", "1", *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "cannot reach" not in err


def test_a_trace_whose_arrivals_are_one_instant_has_no_rate_and_valid_json(server, tmp_path, capsys):
    """Every arrival at one timestamp offers no defined rate: no capacity is claimed from it, and
    the results file stays JSON (no Infinity)."""
    _, url = server
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": TOKENS, "hash_ids": [1, 2]})
                     + "\n")
    out = tmp_path / "r.json"
    assert main(["--url", url, "--trace", str(trace), "--arrival", "trace", "--out", str(out)]) == 0
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert doc["slo_capacity"] is None and doc["runs"][0]["summary"]["offered_rate"] is None
    assert "inf" not in capsys.readouterr().out


def test_a_long_token_prompt_reaches_the_server_whole(server, tmp_path):
    app, url = server
    out = tmp_path / "r.json"
    assert main(["--url", url, "--num-requests", "1", "--input-len", "30000", "--output-len", str(TOKENS),
                 "--rate", "10", "--max-input-len", "30000", "--out", str(out)]) == 0
    prompt = app.state.bodies[-1]["prompt"]
    assert isinstance(prompt, list) and len(prompt) == 30000


def test_a_trace_written_with_another_block_size_is_warned_about(server, tmp_path, capsys):
    _, url = server
    trace = tmp_path / "b16.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 64, "output_length": TOKENS,
                                         "hash_ids": ids}) + "\n" for t, ids in ((0, [1, 2, 3, 4]), (10, [1, 5, 6, 7]))))
    assert main(["--url", url, "--trace", str(trace), "--rate", "50"]) == 0
    err = capsys.readouterr().err
    assert "2 of 2 lines" in err and "--trace-block-size 16 fits every line" in err


def test_ctrl_c_reports_and_saves_the_rates_that_finished(server, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    app, url = server
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.cli", "bench", "--url", url, "--num-requests", "3",
                             "--input-len", "5", "--output-len", str(TOKENS), "--rates", "100,0.01",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell that ran this suite in the background left SIGINT ignored, and an
                            # ignored SIGINT is inherited: Python would then not raise KeyboardInterrupt
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while len(app.state.bodies) < 4 and time.monotonic() < deadline:  # the first rate, and one of the second
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted; reporting the 1 rate(s) that finished" in stderr and "Traceback" not in stderr
    assert "SLO capacity" in stdout
    doc = json.loads(out.read_text())
    assert [r["summary"]["offered_rate"] for r in doc["runs"]] == [100]


def test_request_timeout_bounds_the_whole_answer_not_each_read(server, tmp_path):
    _, url = server  # the answer takes FIRST_TOKEN_S + 3 gaps; no single read waits that long
    rc, doc = run(tmp_path, url, "--request-timeout", str(FIRST_TOKEN_S + GAP_S * 1.5))
    ok = by_index(doc)[0]
    assert ok["status"] == "error" and "--request-timeout" in ok["error"] and ok["ttft_s"] is None


def test_a_prompts_files_requests_are_capped_as_the_options_say(server, tmp_path, capsys):
    app, url = server
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": list(range(1000, 1010)), "max_tokens": 50}) + "\n"
                       + json.dumps({"prompt": "a text", "max_tokens": 2}) + "\n")
    assert main(["--url", url, "--prompts-file", str(prompts), "--rates", "50,100", "--max-input-len", "4",
                 "--max-output-len", "3"]) == 0
    sent = [(b["prompt"], b["max_tokens"]) for b in app.state.bodies]
    assert sent[:2] == [(list(range(1000, 1004)), 3), ("a text", 2)] and sent[2:] == sent[:2]
    assert "sent as written at every rate" in capsys.readouterr().err


def send_one_to(url, prompt, **opts):
    """One request through send_one, its record back; a send_one that never returns fails the test
    in 20 s rather than hanging the suite."""
    from mooncake.bench.runner import ClientOptions, make_client, send_one
    from mooncake.bench.stats import RequestRecord

    async def go():
        options = ClientOptions(url, "fake", **opts)
        client = make_client(options)
        rec = RequestRecord(0, 1, TOKENS, 0.0)
        try:
            await asyncio.wait_for(send_one(client, options, prompt, rec, time.perf_counter()), 20)
        finally:
            await client.close()
        return rec

    return asyncio.run(go())


@pytest.mark.parametrize("header", ["0", "nan", "-3", "inf", "soon"])
def test_retry_after_ends_whatever_the_header_says(server, header):
    """A Retry-After of 0 (or nan or -3, read as 0) used to be retried forever: the sleeps, 0 s
    each, never added up to --max-retry-wait."""
    from mooncake.bench.runner import MAX_ATTEMPTS

    _, url = server
    started = time.perf_counter()
    rec = send_one_to(url, f"retry-after:{header}", retry_after=True, max_retry_wait_s=1.0)
    assert rec.status == "refused" and time.perf_counter() - started < 5
    if header == "0":  # retried at once, until the attempts cap or --max-retry-wait
        assert 1 < rec.attempts <= MAX_ATTEMPTS and rec.end_s - rec.sent_s <= 1.0 + 0.5
    else:  # no usable delay: a refusal, not a retry
        assert rec.attempts == 1 and "no usable Retry-After" in rec.error


def test_max_retry_wait_counts_the_time_of_the_refused_attempts_too(server):
    """Slow 429 answers with Retry-After: 0 still end within --max-retry-wait."""
    _, url = server
    rec = send_one_to(url, "slow-retry-after:0", retry_after=True, max_retry_wait_s=1.0)
    assert rec.status == "refused" and 2 <= rec.attempts <= 6 and "--max-retry-wait 1 s" in rec.error


def test_retry_after_values():
    from mooncake.bench.runner import retry_after_s

    assert retry_after_s({"retry-after": "2.5"}) == 2.5 and retry_after_s({"retry-after": "0"}) == 0.0
    for bad in ("nan", "-1", "inf", "soon", ""):
        assert retry_after_s({"retry-after": bad}) is None


def test_an_answer_cut_short_under_ignore_eos_is_an_error(server, tmp_path, capsys):
    """By the server's usage count it stopped early; counted OK it used to flatter TBT and e2e."""
    _, url = server
    rc, doc = run(tmp_path, url, prompts_sent=("ok", "short", "vllm-error"))
    ok, short, failed = (by_index(doc)[i] for i in range(3))
    assert rc == 0 and ok["status"] == "ok" and ok["tokens_from_usage"]
    assert short["status"] == "error" and short["error"].startswith(f"the answer stopped after 2 of {TOKENS} tokens")
    assert short["ttft_s"] is None
    assert failed["status"] == "error" and failed["error"] == "the server sent an error mid-stream: engine died"
    assert doc["runs"][0]["summary"]["attainment"] == pytest.approx(1 / 3)
    assert "1 x the answer stopped after 2 of" in capsys.readouterr().out
    # without ignore_eos a short answer is a result (EOS), noted as short
    rc, doc = run(tmp_path, url, "--no-ignore-eos", prompts_sent=("short",))
    assert by_index(doc)[0]["status"] == "ok" and doc["runs"][0]["summary"]["short_outputs"] == 1


def test_an_answer_that_ends_without_a_finish_reason_is_an_error_not_a_short_success(server, tmp_path):
    _, url = server
    for flags in ((), ("--no-ignore-eos",)):
        rc, doc = run(tmp_path, url, *flags, prompts_sent=("ok", "cut", "done-early"))
        ok, cut, early = (by_index(doc)[i] for i in range(3))
        assert ok["status"] == "ok"
        for rec in (cut, early):
            assert rec["status"] == "error" and rec["ttft_s"] is None, rec
        assert "no finish_reason" in early["error"]
        assert doc["runs"][0]["summary"]["attainment"] == pytest.approx(1 / 3)


def test_requests_longer_than_the_model_s_context_are_said_before_the_run(server, tmp_path, capsys):
    _, url = server
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": n, "output_length": 8, "hash_ids": []}) + "\n"
                             for i, n in enumerate((100, CONTEXT - 8, CONTEXT, 9000))))
    rc = main(["--url", url, "--trace", str(trace), "--rate", "100", "--trace-block-size", "16"])
    err = capsys.readouterr().err
    assert "2 of 4 requests need more than the model's context of 4,096 tokens (prompt + output up to 9,008)" in err
    main(["--url", url, "--trace", str(trace), "--rate", "100", "--trace-block-size", "16", "--max-input-len", "4000"])
    assert "context" not in capsys.readouterr().err


def test_an_answer_without_usage_is_counted_per_chunk_and_said_so(server, tmp_path, capsys):
    _, url = server
    rc, doc = run(tmp_path, url, prompts_sent=("no-usage",))
    rec, summary = by_index(doc)[0], doc["runs"][0]["summary"]
    assert rc == 0 and rec["status"] == "ok" and rec["tokens"] == TOKENS and not rec["tokens_from_usage"]
    assert summary["without_usage"] == 1 and summary["short_outputs"] == 0
    out = capsys.readouterr().out
    assert "sent no usage count for 1 answers" in out and "counted per text chunk" in out


@pytest.mark.parametrize("answer", [HTMLResponse("<html>a web page</html>"), JSONResponse({"object": "list"}),
                                    JSONResponse([1, 2])])
def test_a_models_url_answering_something_else_is_an_endpoint_error(answer, capsys):
    """A web page at the URL answered 200: the SDK's parser raised an AttributeError."""
    app = FastAPI()
    app.get("/v1/models")(lambda: answer)
    with served(app) as base:
        assert main(["--url", base + "/v1", "--num-requests", "1"]) == 1
    err = capsys.readouterr().err
    assert f"{base}/v1/models answered HTTP 200" in err and "not an OpenAI model list" in err
    assert "Traceback" not in err


def test_a_server_that_takes_the_connection_but_never_answers_is_reported_in_seconds(capsys, monkeypatch):
    """A frozen server accepts into its backlog and answers nothing: the preflight waited for
    --request-timeout (600 s by default), then said "cannot reach ...: " with no reason."""
    import socket

    from mooncake.bench import runner

    monkeypatch.setattr(runner, "PREFLIGHT_TIMEOUT_S", 0.5)
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)  # never accepts
    try:
        started = time.monotonic()
        rc = main(["--url", f"http://127.0.0.1:{frozen.getsockname()[1]}/v1", "--num-requests", "1",
                   "--input-len", "5"])
        assert rc == 1 and time.monotonic() - started < 10
        assert "gave no answer within 0.5 s" in capsys.readouterr().err
    finally:
        frozen.close()


def test_an_output_file_that_cannot_be_written_is_refused_before_the_sweep(server, tmp_path):
    import os

    _, url = server
    out = tmp_path / "r.json"
    out.write_text("{}")
    out.chmod(0o444)
    if os.access(out, os.W_OK):  # root writes anyway: the check below could not fail there
        pytest.skip("running as root: a read-only file is still writable")
    with pytest.raises(SystemExit) as refused:
        main(["--url", url, "--num-requests", "1", "--input-len", "5", "--out", str(out)])
    assert refused.value.code == 2


def test_an_output_that_fails_at_the_end_loses_neither_the_table_nor_the_plots(server, tmp_path, capsys,
                                                                               monkeypatch):
    from mooncake.bench import report

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", full_disk)
    _, url = server
    rc = main(["--url", url, "--num-requests", "2", "--input-len", "5", "--output-len", str(TOKENS), "--rate", "100",
               "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "plots")])
    captured = capsys.readouterr()
    assert rc == 1 and "could not write --out" in captured.err and "No space left" in captured.err
    assert "attain" in captured.out and (tmp_path / "plots" / "ttft_cdf.png").exists()


def test_a_first_token_without_text_yet_is_the_first_token():
    """A token that ends inside a multi-byte character comes as a chunk with empty text: its time is
    the TTFT (as vLLM's own benchmark takes it), not the next chunk's."""
    app = fake_app()
    with served(app) as url:
        rec = send_one_to(url + "/v1", "empty-first")
    assert rec.status == "ok" and rec.tokens == TOKENS and len(rec.chunk_s) == TOKENS
    assert rec.first_token_s - rec.sent_s < FIRST_TOKEN_S + GAP_S / 2, (rec.first_token_s, rec.sent_s)


@pytest.mark.parametrize("header,seconds", [("1500", 1.5), ("nan", None), ("inf", None), ("-3", None), ("x", None),
                                            ("", None)])
def test_a_predicted_ttft_header_that_is_no_duration_is_none(header, seconds):
    from mooncake.bench.runner import PREDICTED_TTFT_HEADER, predicted_ttft_s

    assert predicted_ttft_s({PREDICTED_TTFT_HEADER: header}) == seconds


def test_a_warm_up_of_a_trace_replayed_at_its_timing_keeps_that_timing(server, tmp_path):
    _, url = server
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 64, "output_length": TOKENS, "hash_ids": [i]})
                             + "\n" for i, t in enumerate((1000, 1400, 2600))))
    out = tmp_path / "r.json"
    assert main(["--url", url, "--trace", str(trace), "--trace-block-size", "64", "--arrival", "trace",
                 "--warmup", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    # (It was Poisson at --rate, whatever --arrival said.)
    assert [r["scheduled_s"] for r in doc["warmup"]] == pytest.approx([0.0, 0.4])
    assert [r["scheduled_s"] for r in doc["runs"][0]["requests"]] == pytest.approx([0.0, 0.4, 1.6])
