"""Authentication on the real cluster: API keys on the public API (401 without or with a wrong
key, 403 for a key without access to the model), the cluster token on every internal endpoint
(worker API, KV events, the embedded registry, the KV socket), and malformed or oversized bodies
against the internal endpoints: refused, nothing crashes.

The spine cluster runs with a cluster token (tests/conftest.py); a second conductor in front of
its workers carries the API keys."""

from __future__ import annotations

import secrets
import socket
import struct
import time

import httpx
import openai
import pytest

from messenger.handshake import HELLO, VERSION as HANDSHAKE_VERSION
from messenger.wire import MAGIC, VERSION
from tests.conftest import MODEL_NAME
from tests.processes import closed_by_server, free_port, start, wait_http

pytestmark = pytest.mark.vllm

KEYS_FILE = f"""# keys of the public API
k-file-all
k-file-model   {MODEL_NAME}   # this model only
k-other        other-model, another-model
"""
PROMPT = "The capital of France is"
WORKER_ROUTES = [("GET", "/internal/load"), ("GET", "/internal/kv_events?since=-1"), ("GET", "/internal/kv_stats"),
                 ("POST", "/internal/generate"), ("POST", "/internal/abort"), ("POST", "/internal/kv_drop")]
CONDUCTOR_ROUTES = [("GET", "/internal/registry/instances"), ("POST", "/internal/registry/instances"),
                    ("POST", "/internal/registry/instances/x/heartbeat"), ("DELETE", "/internal/registry/instances/x"),
                    ("GET", "/internal/debug/estimators"), ("POST", "/internal/debug/prefix")]


@pytest.fixture(scope="module")
def keyed_api(spine_cluster, model_path, log_dir):
    """A conductor in front of the spine workers with keys from all three sources."""
    keys = log_dir / "api-keys"
    keys.write_text(KEYS_FILE)
    port = free_port()
    proc = start("conductor-api-keys", [
        "-m", "mooncake.cli", "conductor", "--port", str(port), "--model", model_path,
        "--served-model-name", MODEL_NAME, "--api-keys-file", str(keys), "--api-key", "k-flag",
        "--cluster-token-file", spine_cluster.token_file,
        "--prefill-url", spine_cluster.worker_urls["prefill"], "--decode-url", spine_cluster.worker_urls["decode"]],
        log_dir, env={"MOONCAKE_API_KEYS": "k-env-1, k-env-2"})
    try:
        wait_http(proc, f"http://127.0.0.1:{port}/health", 120)  # 200: it reaches the workers with the token
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()


def client(api: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api, api_key=key, max_retries=0, timeout=120)


def assert_openai_error(resp: httpx.Response, status: int, code: str | None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == code


def test_no_key_or_a_wrong_key_is_401(keyed_api):
    for key in ("wrong", "k-file-all-but-longer", "K-FILE-ALL"):
        with pytest.raises(openai.AuthenticationError) as info:
            client(keyed_api, key).completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        assert info.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(keyed_api, key).chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                                           messages=[{"role": "user", "content": "hi"}])
    for path in ("/models", f"/models/{MODEL_NAME}"):
        assert_openai_error(httpx.get(keyed_api + path), 401, "invalid_api_key")
    # Refused before the body is read: a malformed one is still a 401, not a 400.
    resp = httpx.post(keyed_api + "/completions", content=b"{", headers={"content-type": "application/json"})
    assert_openai_error(resp, 401, "invalid_api_key")


def test_a_key_without_access_to_the_model_is_403(keyed_api):
    other = client(keyed_api, "k-other")
    with pytest.raises(openai.PermissionDeniedError) as info:
        other.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_allowed" and info.value.body["param"] == "model"
    with pytest.raises(openai.PermissionDeniedError):
        other.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert other.models.list().data == []  # it sees only the models it may use
    with pytest.raises(openai.PermissionDeniedError):
        other.models.retrieve(MODEL_NAME)


def test_every_configured_key_opens_the_api(keyed_api):
    answer = client(keyed_api, "k-file-model").completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                                                  temperature=0)
    assert "Paris" in answer.choices[0].text
    for key in ("k-file-all", "k-env-1", "k-env-2", "k-flag"):
        assert [m.id for m in client(keyed_api, key).models.list().data] == [MODEL_NAME], key


def call(method: str, url: str, **kwargs) -> int | str:
    """The status, or "closed" when the server hung up before answering (it may, for a body it
    refused without reading). An error answered is asserted to be in OpenAI's shape."""
    try:
        resp = httpx.request(method, url, timeout=60, **kwargs)
    except httpx.TransportError:
        return "closed"
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (method, url, resp.text)
    return resp.status_code


def test_internal_endpoints_refuse_calls_without_the_cluster_token(spine_cluster):
    wrong = {"X-Mooncake-Cluster-Token": secrets.token_urlsafe(32)}
    targets = [(url, WORKER_ROUTES) for url in spine_cluster.worker_urls.values()]
    targets.append((spine_cluster.base_url, CONDUCTOR_ROUTES))
    for base, routes in targets:
        for method, path in routes:
            for headers in ({}, wrong, {"Authorization": "Bearer anything"}):
                resp = httpx.request(method, base + path, headers=headers, json={"request_id": "r"}, timeout=10)
                assert_openai_error(resp, 401, "invalid_cluster_token")
        # Probes and scrapers need no token.
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        assert httpx.get(base + "/metrics", timeout=10).status_code == 200
    # The new user's finding: KV events answered anyone.
    for url in spine_cluster.worker_urls.values():
        assert httpx.get(url + "/internal/kv_events", timeout=10).status_code == 401
        with_token = httpx.get(url + "/internal/kv_events", headers=spine_cluster.internal_headers, timeout=10)
        assert with_token.status_code == 200 and "stored" in with_token.json()
    token = spine_cluster.internal_headers
    assert httpx.get(spine_cluster.base_url + "/internal/registry/instances", headers=token).status_code == 200


def test_a_conductor_with_another_token_gets_nothing_from_the_workers(spine_cluster, model_path, log_dir):
    token_file = log_dir / "other-token"
    token_file.write_text(secrets.token_urlsafe(32))
    port = free_port()
    proc = start("conductor-wrong-token", [
        "-m", "mooncake.cli", "conductor", "--port", str(port), "--model", model_path,
        "--served-model-name", MODEL_NAME, "--cluster-token-file", str(token_file),
        "--decode-url", spine_cluster.worker_urls["decode"]], log_dir)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(proc, base + "/health", 120, want=503)
        deadline = time.monotonic() + 30
        while (worker := httpx.get(base + "/health").json()["workers"][0])["status"] != "unauthorized":
            assert time.monotonic() < deadline, worker
            time.sleep(0.5)
        assert "cluster token" in worker["error"]
        resp = httpx.post(base + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2},
                          timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["message"]
    finally:
        proc.stop()


def kv_address(spine_cluster, role: str) -> tuple[str, int]:
    host, port = httpx.get(spine_cluster.worker_urls[role] + "/health", timeout=10).json()["kv_address"].rsplit(":", 1)
    return host, int(port)


def test_kv_socket_refuses_connections_without_the_cluster_key(spine_cluster, disaggregated_api):
    before = httpx.get(spine_cluster.worker_urls["decode"] + "/internal/kv_stats",
                       headers=spine_cluster.internal_headers, timeout=10).json()["stats"]
    host, port = kv_address(spine_cluster, "decode")
    huge_put = (struct.pack("!4sB3xIQ", MAGIC, VERSION, 2, 15 << 30) + b"{}")  # claims a 15 GiB payload
    forged = HELLO + bytes([HANDSHAKE_VERSION]) + secrets.token_bytes(32)
    for data in (huge_put, forged + secrets.token_bytes(32), b"GET / HTTP/1.1\r\n\r\n", secrets.token_bytes(1 << 16)):
        with socket.create_connection((host, port), timeout=10) as sock:
            try:
                sock.sendall(data)
                if data.startswith(HELLO):
                    sock.sendall(secrets.token_bytes(32))  # a made-up proof
            except OSError:
                pass  # already hung up on us
            assert len(closed_by_server(sock, within_s=15)) in (0, 64), data[:8]  # 64: its own challenge, nothing else
    # The workers still push and receive KV among themselves.
    resp = httpx.post(disaggregated_api + "/completions", timeout=300, json={
        "model": MODEL_NAME, "prompt": "A fresh prompt to push: " + " ".join(f"k{i}" for i in range(300)),
        "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    after = httpx.get(spine_cluster.worker_urls["decode"] + "/internal/kv_stats",
                      headers=spine_cluster.internal_headers, timeout=10).json()["stats"]
    assert after["loaded_transfers"] == before["loaded_transfers"] + 1
    assert after["load_failures"] == before["load_failures"]


def test_malformed_and_oversized_bodies_to_internal_endpoints_are_refused(spine_cluster):
    token = spine_cluster.internal_headers
    huge = b"[" + b"7," * (25 << 20) + b"7]"  # 50 MB
    bad_bodies = [b"{", b"[1, 2]", b'{"request_id": 5, "transfer_id": [1]}', b"\xff\xfe\x00",
                  b"[" + b"1," * (400 << 10) + b"1]"]  # 800 KB of the wrong type: under the limit, still a 400
    wrong_types = b'{"request_id": "r", "prompt_token_ids": "abc", "sampling": {"max_tokens": -1}}'
    for url in spine_cluster.worker_urls.values():
        assert call("POST", url + "/internal/generate", content=wrong_types, headers=token) == 400
        for path in ("/internal/generate", "/internal/abort", "/internal/kv_drop"):
            for body in bad_bodies:
                assert call("POST", url + path, content=body, headers=token) == 400, (url, path, body[:20])
            assert call("POST", url + path, content=huge, headers=token) in (413, "closed"), (url, path)
            assert call("POST", url + path, content=huge) in (401, "closed"), (url, path)
        assert call("GET", url + "/internal/kv_events?since=notanumber", headers=token) == 400
    registry = spine_cluster.base_url + "/internal/registry/instances"
    for body in (b"{", b'{"info": {"instance_id": 5}, "ttl_s": "x"}', b"[]"):
        assert call("POST", registry, content=body, headers=token) == 400, body
    assert call("POST", registry, content=huge, headers=token) in (413, "closed")
    assert call("POST", registry, content=huge) in (401, "closed")
    # Nothing registered, nothing crashed: both workers healthy, the cluster answers.
    listed = httpx.get(registry, headers=token, timeout=10).json()["instances"]
    assert {i["instance_id"] for i in listed} == {"prefill-0", "decode-1"}
    for url in spine_cluster.worker_urls.values():
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ready"
    resp = httpx.post(spine_cluster.api + "/completions", timeout=120,
                      json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200 and "Paris" in resp.json()["choices"][0]["text"]
