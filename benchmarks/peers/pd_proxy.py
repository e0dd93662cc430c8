"""A proxy in front of one vLLM prefill server and one vLLM decode server that use vLLM's own
MooncakeConnector (the peer of issue #12). OpenAI `/v1/completions` (streamed or not),
`/v1/models`, `/health`.

How vLLM's MooncakeConnector hands a request over (vllm/distributed/kv_transfer/kv_connector/
v1/mooncake/mooncake_connector.py, vLLM 0.32):
- The producer (P) is asked with `kv_transfer_params = {do_remote_decode: True, transfer_id}`.
  When its request ends *length-capped* it keeps the prompt's blocks until a consumer pulls them
  (or VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, 480 s, passes). Any other end (EOS, abort) frees them
  at once. P returns no kv_transfer_params: the proxy makes the transfer id and knows P's
  engine id and bootstrap address (both fixed when P was started).
- The consumer (D) is asked with `{do_remote_prefill: True, remote_engine_id,
  remote_bootstrap_addr, transfer_id}` and the same prompt: it asks P's bootstrap server where
  P's workers are, pulls the prompt's KV over the transfer engine, recomputes the last prompt
  token and generates from there, so D's first token is its own (equal to P's under greedy
  decoding; for sampling the proxy gives both the same seed, so they draw the same token).

What the proxy does per request:
1. P with max_tokens=1 (non-streamed: it is one token). If that one token ends the request
   (EOS or a stop token: finish_reason "stop"; or the client asked for one token, in which
   case P is asked without KV transfer at all), the answer comes from P alone and D is never
   involved, so nothing waits for a transfer. One case still leaves P holding blocks: a stop
   *string* matched by P's front end after its engine had already ended the request
   length-capped; then D is sent the hand-over with max_tokens=1 in the background, which pulls
   and so frees P's blocks.
2. Otherwise D with the full request; streamed answers send P's first token to the client at
   once (TTFT as a user sees it), then D's text after its first token.
Every read from either server is bounded (`--timeout-s`); failures become OpenAI-style errors,
mid-stream as an error event followed by `data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

log = logging.getLogger("pd_proxy")


@dataclass(frozen=True)
class ProxyConfig:
    prefill_url: str          # P's base URL, e.g. http://127.0.0.1:8100 (no /v1)
    decode_url: str           # D's base URL
    prefill_engine_id: str    # the engine_id in P's --kv-transfer-config
    bootstrap_addr: str       # P's Mooncake bootstrap server, e.g. http://127.0.0.1:8998
    timeout_s: float = 300.0  # bound on connecting to and on each read from either server

    def __post_init__(self):
        for name in ("prefill_url", "decode_url", "bootstrap_addr"):
            if not getattr(self, name).startswith("http"):
                raise ValueError(f"{name} must be an http URL, got {getattr(self, name)!r}")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


def error_response(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def upstream_error(who: str, resp: httpx.Response) -> JSONResponse:
    """An error answer from P or D, passed on as OpenAI-style JSON with its status."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return JSONResponse(body, status_code=resp.status_code)
    return error_response(resp.status_code, f"{who} server answered {resp.status_code}: "
                                            f"{resp.text[:500]}", "upstream_error")


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def error_event(message: str) -> bytes:
    return sse({"error": {"message": message, "type": "upstream_error", "code": 502}})


def create_app(config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """`transport` replaces the network in tests (fake P and D servers)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = httpx.Timeout(config.timeout_s, connect=10.0)
        app.state.client = httpx.AsyncClient(timeout=timeout, transport=transport,
                                             limits=httpx.Limits(max_connections=None))
        app.state.background = set()   # release requests in flight (strong references)
        yield
        for task in app.state.background:
            task.cancel()
        await app.state.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health(request: Request):
        client: httpx.AsyncClient = request.app.state.client
        for who, url in (("prefill", config.prefill_url), ("decode", config.decode_url)):
            try:
                resp = await client.get(f"{url}/health", timeout=5)
            except httpx.HTTPError as e:
                return error_response(503, f"{who} server unreachable: {e!r}")
            if resp.status_code != 200:
                return error_response(503, f"{who} server /health: {resp.status_code}")
        # The servers' URLs let a check read their own /metrics (benchmarks/peer_smoke.py).
        return {"status": "ok", "prefill": config.prefill_url, "decode": config.decode_url}

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            resp = await request.app.state.client.get(f"{config.prefill_url}/v1/models")
        except httpx.HTTPError as e:
            return error_response(502, f"prefill server unreachable: {e!r}")
        if resp.status_code != 200:
            return upstream_error("prefill", resp)
        return resp.json()

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object", "invalid_request_error")
        if body.get("n", 1) != 1 or body.get("best_of", 1) not in (1, None):
            return error_response(400, "this proxy serves n=1 only", "invalid_request_error")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return error_response(400, "one prompt per request (a string or a list of token ids)",
                                  "invalid_request_error")
        return await serve_completion(request.app, config, body)

    return app


async def serve_completion(app: FastAPI, config: ProxyConfig, body: dict):
    client: httpx.AsyncClient = app.state.client
    stream = bool(body.get("stream", False))
    # vLLM's default for /v1/completions is 16; an explicit null means "up to the context".
    max_tokens = body.get("max_tokens", 16)
    body = dict(body)
    # Sampling: P and D each draw "the first token". The same seed makes them draw the same one.
    if body.get("temperature", 1.0) != 0 and body.get("seed") is None:
        body["seed"] = random.randrange(2**31)
    transfer_id = f"xfer-{uuid.uuid4().hex}"
    hand_over = max_tokens != 1
    prefill_body = {**body, "stream": False, "max_tokens": 1,
                    "min_tokens": min(body.get("min_tokens") or 0, 1)}
    prefill_body.pop("stream_options", None)
    if hand_over:
        prefill_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                              "transfer_id": transfer_id}
    try:
        p_resp = await client.post(f"{config.prefill_url}/v1/completions", json=prefill_body)
    except httpx.HTTPError as e:
        return error_response(502, f"prefill server failed: {e!r}")
    if p_resp.status_code != 200:
        return upstream_error("prefill", p_resp)
    first = p_resp.json()
    choice = first["choices"][0]
    decode_params = {"do_remote_prefill": True, "do_remote_decode": False,
                     "remote_engine_id": config.prefill_engine_id,
                     "remote_bootstrap_addr": config.bootstrap_addr, "transfer_id": transfer_id}

    if not hand_over or choice["finish_reason"] != "length":
        if hand_over and isinstance(choice.get("stop_reason"), str):
            # A stop string matched in P's front end; its engine had already ended the request
            # length-capped and holds the blocks for D. Let D pull them, so they are freed now.
            release = {**body, "stream": False, "max_tokens": 1, "min_tokens": 0,
                       "kv_transfer_params": decode_params}
            release.pop("stream_options", None)
            task = asyncio.create_task(release_prefill_blocks(client, config, release))
            app.state.background.add(task)
            task.add_done_callback(app.state.background.discard)
        if not stream:
            return first
        return StreamingResponse(prefill_only_stream(first, body), media_type="text/event-stream")

    decode_body = {**body, "kv_transfer_params": decode_params}
    if not stream:
        try:
            d_resp = await client.post(f"{config.decode_url}/v1/completions", json=decode_body)
        except httpx.HTTPError as e:
            return error_response(502, f"decode server failed: {e!r}")
        if d_resp.status_code != 200:
            return upstream_error("decode", d_resp)
        return d_resp.json()
    return StreamingResponse(handed_over_stream(client, config, first, decode_body),
                             media_type="text/event-stream")


async def release_prefill_blocks(client: httpx.AsyncClient, config: ProxyConfig, body: dict):
    try:
        resp = await client.post(f"{config.decode_url}/v1/completions", json=body)
        if resp.status_code != 200:
            log.warning("releasing P's blocks via D: %s %s", resp.status_code, resp.text[:200])
    except httpx.HTTPError as e:
        log.warning("releasing P's blocks via D failed: %r", e)


def chunk_from(first: dict, cid: str, text: str, finish_reason, stop_reason=None) -> dict:
    return {"id": cid, "object": "text_completion", "created": first.get("created", int(time.time())),
            "model": first["model"],
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}


async def prefill_only_stream(first: dict, body: dict):
    choice = first["choices"][0]
    yield sse(chunk_from(first, first["id"], choice["text"], choice["finish_reason"],
                         choice.get("stop_reason")))
    if (body.get("stream_options") or {}).get("include_usage"):
        yield sse({"id": first["id"], "object": "text_completion", "created": first["created"],
                   "model": first["model"], "choices": [], "usage": first.get("usage")})
    yield b"data: [DONE]\n\n"


async def handed_over_stream(client: httpx.AsyncClient, config: ProxyConfig, first: dict,
                             decode_body: dict):
    """P's first token at once, then D's stream minus D's own first token (by its text)."""
    cid = first["id"]
    first_text = first["choices"][0]["text"]
    yield sse(chunk_from(first, cid, first_text, None))
    skip = len(first_text)  # characters of D's text that P's token already delivered
    try:
        async with client.stream("POST", f"{config.decode_url}/v1/completions",
                                 json=decode_body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                yield error_event(f"decode server answered {resp.status_code}: {text[:500]}")
                yield b"data: [DONE]\n\n"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data.strip() == "[DONE]":
                    yield b"data: [DONE]\n\n"
                    return
                obj = json.loads(data)
                obj["id"] = cid
                for c in obj.get("choices") or []:
                    text = c.get("text") or ""
                    cut = min(skip, len(text))
                    c["text"], skip = text[cut:], skip - cut
                choices = obj.get("choices") or []
                if choices and not choices[0]["text"] and choices[0].get("finish_reason") is None:
                    continue  # only D's repeat of the first token
                yield sse(obj)
        yield error_event("decode server's stream ended without [DONE]")
    except (httpx.HTTPError, ValueError) as e:
        yield error_event(f"decode server failed mid-stream: {e!r}")
    yield b"data: [DONE]\n\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill-url", required=True)
    parser.add_argument("--decode-url", required=True)
    parser.add_argument("--prefill-engine-id", required=True)
    parser.add_argument("--bootstrap-addr", required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = ProxyConfig(args.prefill_url.rstrip("/"), args.decode_url.rstrip("/"),
                         args.prefill_engine_id, args.bootstrap_addr.rstrip("/"), args.timeout_s)
    uvicorn.run(create_app(config), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
