"""Cluster token and API keys, piece by piece (no engine): the token's sources and the refusal to
start without one, the API keys file, the guards of the real worker and conductor apps, the
embedded registry over a real socket, and the KV transfer engine's handshake over real TCP.
The same checks against the real cluster are in tests/e2e/test_auth.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import socket
import struct
import time

import httpx
import numpy as np
import pytest

from conductor.auth import ApiKey, find_key, load_api_keys, parse_keys_file
from messenger.api import Slice, TransferError
from messenger.engine import EngineConfig, TransferEngine
from messenger.wire import MAGIC, VERSION
from mooncake.auth import (NO_TOKEN_HELP, TOKEN_HEADER, ClusterTokenError, generate_token, kv_key, load_token,
                           token_matches)
from mooncake.cli import build_parser, main
from tests.processes import closed_by_server

TOKEN = "t0ken-" + "x" * 26
GOOD = {TOKEN_HEADER: TOKEN}


# -- the token's sources ------------------------------------------------------------------------

def test_token_comes_from_the_file_then_the_environment(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_token(str(path), {"MOONCAKE_CLUSTER_TOKEN": "other-" + "y" * 20}) == TOKEN
    assert load_token(None, {"MOONCAKE_CLUSTER_TOKEN": TOKEN}) == TOKEN
    assert load_token(None, {}) is None
    with pytest.raises(ClusterTokenError, match="at least 16"):
        load_token(None, {"MOONCAKE_CLUSTER_TOKEN": "short"})
    with pytest.raises(ClusterTokenError, match="cannot read"):
        load_token(str(tmp_path / "missing"), {})
    path.write_text("two words-but-long-enough-anyway")
    with pytest.raises(ClusterTokenError, match="without spaces"):
        load_token(str(path), {})
    # Printable but not ASCII: an HTTP header could not carry it (httpx refuses to encode it).
    with pytest.raises(ClusterTokenError, match="ASCII"):
        load_token(None, {"MOONCAKE_CLUSTER_TOKEN": "t\u00f6ken-" + "\u00e9" * 20})
    with pytest.raises(UnicodeEncodeError):
        httpx.Request("GET", "http://w/", headers={TOKEN_HEADER: "t\u00f6ken-" + "\u00e9" * 20})
    assert len(generate_token()) >= 32 and generate_token() != generate_token()
    assert token_matches(TOKEN, TOKEN) and not token_matches(TOKEN[:-1], TOKEN) and not token_matches(None, TOKEN)
    assert kv_key(TOKEN) != TOKEN.encode() and len(kv_key(TOKEN)) == 32


@pytest.mark.parametrize("command", ["prefill", "decode", "conductor"])
def test_multi_host_processes_refuse_to_start_without_a_token(command, monkeypatch, capsys):
    monkeypatch.delenv("MOONCAKE_CLUSTER_TOKEN", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main([command])  # would load a model and serve if the check let it through
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--cluster-token-file" in err and "--insecure-no-cluster-token" in err and "Traceback" not in err
    args = build_parser().parse_args([command, "--insecure-no-cluster-token"])
    assert args.check(args) == []  # the explicit opt-out
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", TOKEN)
    args = build_parser().parse_args([command, "--insecure-no-cluster-token"])
    assert "contradicts" in " ".join(args.check(args))
    args = build_parser().parse_args([command])
    assert args.check(args) == []


def test_serve_needs_no_token_but_refuses_an_unusable_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MOONCAKE_CLUSTER_TOKEN", raising=False)
    args = build_parser().parse_args(["serve"])
    assert args.check(args) == []  # it generates its own
    bad = tmp_path / "token"
    bad.write_text("abc")
    args = build_parser().parse_args(["serve", "--cluster-token-file", str(bad)])
    assert "at least 16" in " ".join(args.check(args))
    assert NO_TOKEN_HELP.startswith("no cluster token")


# -- API keys -----------------------------------------------------------------------------------

def test_api_keys_file_lists_keys_and_the_models_each_may_use(tmp_path):
    keys = parse_keys_file("# team keys\nk-all\nk-star   *\nk-two\tm1,m2  # two models\n\n  k-one m1\n")
    assert keys == (ApiKey("k-all"), ApiKey("k-star"), ApiKey("k-two", frozenset({"m1", "m2"})),
                    ApiKey("k-one", frozenset({"m1"})))
    assert keys[2].allows("m2") and not keys[3].allows("m2") and keys[0].allows("anything")
    assert "k-all" not in repr(keys)  # keys never reach a log through a config's repr
    assert parse_keys_file("k2 m1, m2")[0].models == {"m1", "m2"}
    with pytest.raises(ValueError, match="line 2"):
        parse_keys_file("k1\nk2 m1 m2\n")
    with pytest.raises(ValueError, match="listed twice"):
        parse_keys_file("k1\nk1 m1\n")
    path = tmp_path / "keys"
    path.write_text("k-file m1\n")
    merged = load_api_keys(str(path), "k-flag", environ={"MOONCAKE_API_KEYS": "k-env1, k-env2"})
    assert [k.key for k in merged] == ["k-file", "k-env1", "k-env2", "k-flag"]
    assert load_api_keys(None, None, environ={}) == ()
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"), environ={})


def test_find_key_takes_only_a_bearer_header_with_a_known_key():
    keys = (ApiKey("alpha"), ApiKey("beta", frozenset({"m"})))
    assert find_key(keys, b"Bearer beta") == keys[1]
    assert find_key(keys, b"bearer alpha") == keys[0]
    for header in (None, b"", b"Bearer", b"Bearer gamma", b"Basic alpha", b"alpha", b"Bearer alph"):
        assert find_key(keys, header) is None, header


# -- the worker's HTTP app ----------------------------------------------------------------------

def worker_app(tmp_path, token: str | None = TOKEN):
    from mooncake.control import ControlEndpoint
    from mooncake.engine.app import create_app
    from mooncake.engine.config import WorkerConfig

    config = WorkerConfig(role="decode", model="m", served_model_name="m", cluster_token=token)
    return create_app(config, 1, 2, ControlEndpoint(str(tmp_path / "none.sock"), "00" * 16))


def ready_worker_app(tmp_path):
    """As above, its engine marked ready (the lifespan that builds vLLM never runs; no request
    here is valid enough to reach it)."""
    app = worker_app(tmp_path)
    app.state.worker.engine = object()
    return app


def asgi(app, base: str = "http://w") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base)


WORKER_ROUTES = [("GET", "/internal/load"), ("GET", "/internal/kv_events?since=-1"), ("GET", "/internal/kv_stats"),
                 ("POST", "/internal/generate"), ("POST", "/internal/abort"), ("POST", "/internal/kv_drop"),
                 ("GET", "/internal/no-such-route")]


def test_every_internal_route_of_a_worker_needs_the_token(tmp_path):
    async def run():
        async with asgi(worker_app(tmp_path)) as c:
            for method, path in WORKER_ROUTES:
                for headers in ({}, {TOKEN_HEADER: "wrong-" + "z" * 26}, {TOKEN_HEADER: ""}):
                    resp = await c.request(method, path, headers=headers, json={"request_id": "r"})
                    assert resp.status_code == 401, (method, path, headers, resp.text)
                    error = resp.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == "invalid_cluster_token" and TOKEN_HEADER in error["message"]
            assert (await c.get("/internal/load", headers=GOOD)).status_code == 200
            assert (await c.get("/internal/kv_events?since=-1", headers=GOOD)).json()["reset"] is True
            # Spellings of a path that could slip past a prefix check reach no route either.
            for path in ("//internal/load", "/internal/load/", "/internal//load", "/INTERNAL/load",
                         "/internal/%6Coad", "/./internal/load", "/health/../internal/load"):
                resp = await c.get(path)
                assert resp.status_code in (401, 404, 307) and "running_requests" not in resp.text, path
            # Probes and scrapers need no token; /health says whether the caller's token is good.
            health = await c.get("/health")
            assert health.status_code == 503 and health.json()["cluster_token_accepted"] is False
            assert (await c.get("/health", headers=GOOD)).json()["cluster_token_accepted"] is True
            assert (await c.get("/metrics")).status_code == 200
    asyncio.run(run())


def test_a_worker_without_a_token_is_open_and_says_nothing_about_tokens(tmp_path):
    async def run():
        async with asgi(worker_app(tmp_path, token=None)) as c:
            assert (await c.get("/internal/load")).status_code == 200
            assert "cluster_token_accepted" not in (await c.get("/health")).json()
    asyncio.run(run())


def openai_error(resp, status: int, code: str | None = None) -> dict:
    """The error of `resp`, asserted to be `status` in OpenAI's shape (with `code` if given)."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert code is None or error["code"] == code, error
    return error


def test_worker_refuses_malformed_and_oversized_bodies_and_keeps_serving(tmp_path):
    async def run():
        async with asgi(ready_worker_app(tmp_path)) as c:
            big = b"[" + b"1," * (10 << 20) + b"1]"  # 20 MB: over the 16 MiB limit
            for path in ("/internal/generate", "/internal/abort", "/internal/kv_drop"):
                for body in (b"{", b"[1, 2]", b'{"request_id": 5}', b"\xff\xfe", b""):
                    openai_error(await c.post(path, content=body, headers=GOOD), 400, "invalid_value")
                openai_error(await c.post(path, content=big, headers=GOOD), 413, "request_too_large")

                async def chunks():  # no Content-Length: the limit is counted while reading
                    for _ in range(20):
                        yield b"x" * (1 << 20)
                openai_error(await c.post(path, content=chunks(), headers=GOOD), 413, "request_too_large")
                openai_error(await c.post(path, content=big), 401)  # no token: refused first
            # FastAPI's own answers too: a query parameter of the wrong type is a 400 (not a 422
            # {"detail"}), an unknown route a 404, in the same shape.
            error = openai_error(await c.get("/internal/kv_events?since=notanumber", headers=GOOD), 400,
                                 "invalid_value")
            assert error["param"] == "since"
            openai_error(await c.get("/internal/no-such-route", headers=GOOD), 404)
            openai_error(await c.post("/internal/load", headers=GOOD), 405)
            assert (await c.get("/internal/load", headers=GOOD)).status_code == 200
        app = worker_app(tmp_path)  # its engine not started: the conductor tries another worker
        async with asgi(app) as c:
            body = b'{"request_id": "r", "prompt_token_ids": [1], "sampling": {"max_tokens": 1}}'
            openai_error(await c.post("/internal/generate", content=body, headers=GOOD), 503, "not_ready")
    asyncio.run(run())


# -- the conductor's app ------------------------------------------------------------------------

def conductor_app(tmp_path):
    from conductor.app import create_app
    from conductor.config import ConductorConfig

    keys = (ApiKey("k-all"), ApiKey("k-other", frozenset({"other-model"})), ApiKey("k-m", frozenset({"m"})))
    return create_app(ConductorConfig(model_path=str(tmp_path), served_model_name="m", api_keys=keys,
                                      cluster_token=TOKEN))


def test_conductor_asks_api_keys_on_v1_and_the_token_on_internal(tmp_path):
    async def run():
        app = conductor_app(tmp_path)  # no lifespan: no workers, no tokenizer
        async with asgi(app, "http://c") as c:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k-all"}):
                for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/m"),
                                     ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                     ("POST", "/v1/no-such-route"), ("POST", "/tokenize"), ("POST", "/detokenize")):
                    resp = await c.request(method, path, headers=headers, content=b"{")
                    assert resp.status_code == 401, (method, path, headers)
                    assert resp.json()["error"]["code"] == "invalid_api_key"
            listed = (await c.get("/v1/models", headers={"Authorization": "Bearer k-all"})).json()["data"]
            assert [m["id"] for m in listed] == ["m"]
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer k-m"})).json()["data"] == listed
            other = {"Authorization": "Bearer k-other"}
            assert (await c.get("/v1/models", headers=other)).json()["data"] == []  # only its models
            resp = await c.get("/v1/models/m", headers=other)
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "model_not_allowed"
            assert resp.json()["error"]["type"] == "permission_error"
            resp = await c.post("/tokenize", headers=other, json={"model": "m", "prompt": "x"})
            assert resp.status_code == 403  # a key's models bound vLLM's tokenizer routes too
            # Internal routes: the cluster token, never an API key.
            for path in ("/internal/registry/instances", "/internal/debug/estimators"):
                for headers in ({}, {"Authorization": "Bearer k-all"}, {TOKEN_HEADER: TOKEN + "x"}):
                    assert (await c.get(path, headers=headers)).status_code == 401, (path, headers)
            assert (await c.get("/internal/registry/instances", headers=GOOD)).status_code == 200
            resp = await c.post("/internal/registry/instances", headers=GOOD, content=b"x" * (17 << 20))
            assert resp.status_code == 413 and resp.json()["error"]["type"] == "request_too_large"
            assert (await c.get("/metrics")).status_code == 200  # open for Prometheus
            installed = importlib.metadata.version("mooncake-serve")  # pyproject's, as installed by `make setup`
            assert (await c.get("/version")).json() == {"version": installed}  # open, as vLLM's
    asyncio.run(run())


def test_conductor_counts_the_requests_refused_before_its_handler(tmp_path):
    async def run():
        app = conductor_app(tmp_path)  # no lifespan: nothing valid could be served
        key = {"Authorization": "Bearer k-all"}
        async with asgi(app, "http://c") as c:
            assert (await c.post("/v1/completions", json={"model": "m", "prompt": "a"})).status_code == 401
            assert (await c.post("/v1/chat/completions", headers=key, json={"model": "m"})).status_code == 400
            assert (await c.post("/v1/completions", headers=key,
                                 json={"model": "m", "prompt": "a", "n": 0})).status_code == 400
            assert (await c.post("/v1/completions", headers=key, content=b"x" * (17 << 20))).status_code == 413

            async def chunks():  # no Content-Length: refused while the handler reads it
                for _ in range(20):
                    yield b"x" * (1 << 20)
            assert (await c.post("/v1/completions", headers=key, content=chunks())).status_code == 413
            assert (await c.get("/v1/models", headers={})).status_code == 401  # not a counted endpoint
        m = app.state.metrics
        assert m.value("mooncake_requests_total", endpoint="completions", status="401", slo_class="default") == 1
        assert m.value("mooncake_requests_total", endpoint="chat", status="400", slo_class="default") == 1
        assert m.value("mooncake_requests_total", endpoint="completions", status="400", slo_class="default") == 1
        assert m.value("mooncake_requests_total", endpoint="completions", status="413", slo_class="default") == 2
    asyncio.run(run())


# -- the embedded registry over a real socket ---------------------------------------------------

def test_registry_client_sends_the_token_and_a_wrong_one_is_refused():
    import uvicorn
    from fastapi import FastAPI

    from mooncake.auth import ClusterTokenGuard
    from mooncake.net import free_port
    from mooncake.registry import MemoryRegistry, RegistryConfig, RegistryRefused, open_registry
    from mooncake.registry.http import registry_router
    from tests.registry.support import info

    async def run():
        port = free_port()
        registry = MemoryRegistry()
        app = FastAPI()
        app.include_router(registry_router(registry))
        app.add_middleware(ClusterTokenGuard, token=TOKEN)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.02)
        url = f"embedded+http://127.0.0.1:{port}"
        try:
            good = open_registry(RegistryConfig(url=url, ttl_s=2.0, cluster_token=TOKEN))
            await good.register(info("p0"), 2.0)
            assert set(registry.list()) == {"p0"}
            for token in (None, "wrong-" + "w" * 20):
                bad = open_registry(RegistryConfig(url=url, ttl_s=2.0, cluster_token=token))
                with pytest.raises(RegistryRefused, match="401.*cluster token"):
                    await bad.register(info("intruder"), 2.0)
                await bad.close()
            assert set(registry.list()) == {"p0"}
            await good.close()
        finally:
            server.should_exit = True
            await serving
    asyncio.run(run())


def test_a_conductor_following_another_ones_embedded_registry_sends_the_token(tmp_path):
    from conductor.app import create_app, followed_registry
    from conductor.config import ConductorConfig

    async def run():
        leader = create_app(ConductorConfig(model_path=str(tmp_path), served_model_name="m", cluster_token=TOKEN))
        config = ConductorConfig(model_path=str(tmp_path), served_model_name="m", cluster_token=TOKEN,
                                 registry_url="embedded+http://leader:8000")
        follower = followed_registry(config)
        http = follower._http  # the same client, its requests carried to the leader's app in-process
        follower._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=leader), base_url=http.base_url,
                                           headers=http.headers)
        await http.aclose()
        assert await follower.snapshot() == {}  # a 401 would raise RegistryUnavailable
        await follower.close()
    asyncio.run(run())


# -- the KV transfer engine ----------------------------------------------------------------------

def kv_engine(name, key, dst=None):
    engine = TransferEngine(name, EngineConfig(transports=("tcp",), timeout_s=3.0, auth_key=key))
    engine.register(name, dst if dst is not None else np.zeros(4096, dtype=np.uint8))
    return engine


def write(sender, receiver_info, n=16):
    sender.add_peer(receiver_info)
    sender.write(receiver_info.name, [Slice("src", 0, receiver_info.name, 0, n)], b"note").wait(5)


@pytest.fixture
def kv_server():
    engine = kv_engine("dst", kv_key(TOKEN))
    info = engine.start()
    yield engine, info
    engine.close()


def test_kv_engine_talks_only_to_holders_of_the_key(kv_server):
    _, info = kv_server
    good = kv_engine("src", kv_key(TOKEN))
    good.start()
    write(good, info)
    for key in (None, kv_key("another-token-" + "q" * 20)):
        stranger = kv_engine("src", key)
        stranger.start()
        start = time.monotonic()
        with pytest.raises(TransferError):
            write(stranger, info)
        assert time.monotonic() - start < 3.5  # refused, or at worst the engine's timeout
        stranger.close()
    # A sender with the key refuses a receiver without it (it would be handing KV to a stranger).
    plain = kv_engine("dst", None)
    plain_info = plain.start()
    try:
        with pytest.raises(TransferError):
            write(good, plain_info)
    finally:
        plain.close()
    write(good, info, 32)  # still serving
    good.close()


def test_kv_engine_drops_garbage_and_keeps_serving(kv_server):
    _, info = kv_server
    host, port = info.transports["tcp"].rsplit(":", 1)
    huge = struct.pack("!4sB3xIQ", MAGIC, VERSION, 2, 15 << 30) + b"{}"  # claims a 15 GiB payload
    for data in (huge, b"GET / HTTP/1.1\r\n\r\n", b"MCKA\x01" + b"\0" * 64, b"\xff" * 4096):
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(data)
            # Nothing but, for a well-formed hello, the server's own challenge (nonce + proof).
            assert len(closed_by_server(sock)) in (0, 64), data[:16]
    good = kv_engine("src", kv_key(TOKEN))
    good.start()
    write(good, info, 1000)
    good.close()


def test_etcd_credentials_given_by_halves_are_refused_up_front(monkeypatch):
    monkeypatch.setenv("MOONCAKE_CLUSTER_TOKEN", TOKEN)
    monkeypatch.setenv("MOONCAKE_ETCD_USER", "mooncake")
    monkeypatch.delenv("MOONCAKE_ETCD_PASSWORD", raising=False)
    for command in ("prefill", "conductor"):
        args = build_parser().parse_args([command])
        assert "MOONCAKE_ETCD_PASSWORD" in " ".join(args.check(args))
