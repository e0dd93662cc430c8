"""The peer's P/D proxy against fake prefill and decode servers (no engine)."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient

from benchmarks.peers.pd_proxy import ProxyConfig, create_app

P, D = "http://p", "http://d"
CONFIG = ProxyConfig(P, D, "engine-p", "http://p-boot:9", timeout_s=5)


def completion(text: str, finish: str, stop_reason=None) -> dict:
    return {"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def sse_body(texts: list[str], finish: str = "length") -> bytes:
    out = b""
    for i, t in enumerate(texts):
        c = completion(t, finish if i == len(texts) - 1 else None)
        c["id"] = "cmpl-d"
        out += f"data: {json.dumps(c)}\n\n".encode()
    return out + b"data: [DONE]\n\n"


class Fakes:
    """P answers `p_answer`; D answers its tokens (" Paris", ".", " It") or `d_status`."""

    def __init__(self, p_answer: dict, d_status: int = 200):
        self.p_answer, self.d_status = p_answer, d_status
        self.p_bodies, self.d_bodies = [], []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.host == "p":
            self.p_bodies.append(body)
            return httpx.Response(200, json=self.p_answer)
        self.d_bodies.append(body)
        if self.d_status != 200:
            return httpx.Response(self.d_status, json={"error": {"message": "boom"}})
        if body.get("stream"):
            return httpx.Response(200, content=sse_body([" Paris", ".", " It"]))
        return httpx.Response(200, json=completion(" Paris. It", "length"))


def client_for(fakes: Fakes) -> TestClient:
    return TestClient(create_app(CONFIG, transport=httpx.MockTransport(fakes)))


def streamed_text(resp: httpx.Response) -> tuple[str, list[dict]]:
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_hand_over_streams_p_first_token_then_d_without_its_repeat():
    fakes = Fakes(completion(" Paris", "length"))
    with client_for(fakes) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                    "temperature": 0, "stream": True})
    text, events = streamed_text(resp)
    assert text == " Paris. It"
    assert events[0]["choices"][0]["text"] == " Paris" and resp.text.endswith("data: [DONE]\n\n")
    (p_body,), (d_body,) = fakes.p_bodies, fakes.d_bodies
    assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"]
    d_params = d_body["kv_transfer_params"]
    assert d_params["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
    assert d_params["remote_engine_id"] == "engine-p"
    assert d_params["remote_bootstrap_addr"] == "http://p-boot:9"


def test_non_streamed_hand_over_returns_d_answer():
    fakes = Fakes(completion(" Paris", "length"))
    with client_for(fakes) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                    "temperature": 0})
    assert resp.json()["choices"][0]["text"] == " Paris. It"


def test_eos_first_token_answers_from_prefill_alone():
    fakes = Fakes(completion("", "stop"))
    with client_for(fakes) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8,
                                                    "stream": True})
        plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8})
    _, events = streamed_text(resp)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    assert fakes.d_bodies == []


def test_one_token_request_skips_the_transfer():
    fakes = Fakes(completion(" Paris", "length"))
    with client_for(fakes) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert resp.json()["choices"][0]["text"] == " Paris"
    assert "kv_transfer_params" not in fakes.p_bodies[0] and fakes.d_bodies == []


def test_stop_string_at_once_releases_prefill_blocks_via_decode():
    fakes = Fakes(completion("", "stop", stop_reason=" P"))
    with client_for(fakes) as client:
        resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8,
                                                    "stop": [" P"]})
    assert resp.json()["choices"][0]["finish_reason"] == "stop"
    (release,) = fakes.d_bodies  # sent in the background, done before the app shut down
    assert release["max_tokens"] == 1 and release["kv_transfer_params"]["do_remote_prefill"]


def test_decode_failure_becomes_an_error_not_a_hang():
    fakes = Fakes(completion(" Paris", "length"), d_status=500)
    with client_for(fakes) as client:
        plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        streamed = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3,
                                                        "stream": True})
    assert plain.status_code == 500 and plain.json()["error"]["message"] == "boom"
    _, events = streamed_text(streamed)
    assert "error" in events[-1] and streamed.text.endswith("data: [DONE]\n\n")
