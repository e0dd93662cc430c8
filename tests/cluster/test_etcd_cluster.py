"""A real cluster: etcd, two prefill workers, one decode worker and the conductor, each its own
process, registered through etcd and routed by the scheduling core.

One cluster serves the whole module, in order: routing by prefix and by load, a prefill worker
killed under traffic and brought back, etcd restarted under load, and SLO rejections.
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import signal
import time
import uuid

import httpx
import openai
import pytest

from mooncake.auth import TOKEN_HEADER
from tests.conftest import MODEL_NAME
from tests.etcd_server import EtcdServer
from tests.prefix_index import wait_cached
from tests.processes import KV_CACHE_GIB, Proc, free_port, start, wait_http

pytestmark = [pytest.mark.vllm, pytest.mark.etcd]
TTL = 4.0
PREFILLS = ("prefill-a", "prefill-b")


class EtcdCluster:
    def __init__(self, etcd: EtcdServer, model: str, log_dir):
        self.etcd, self.model, self.log_dir = etcd, model, log_dir
        self.port = free_port()
        self.workers: dict[str, Proc] = {}
        self.worker_ports = {name: free_port() for name in (*PREFILLS, "decode-a")}
        self.conductor: Proc | None = None
        # Every process of a multi-host cluster shares one cluster token (secure by default).
        self.token_file = str(log_dir / "cluster-token")
        (log_dir / "cluster-token").write_text(secrets.token_urlsafe(32))

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start_worker(self, name: str) -> Proc:
        role, cores = ("decode", "1") if name.startswith("decode") else ("prefill", "0" if name.endswith("a") else "1")
        proc = start(f"{name}-{len(self.workers)}", [
            "-m", "mooncake.cli", role, "--model", self.model, "--served-model-name", MODEL_NAME,
            "--port", str(self.worker_ports[name]), "--instance-id", name, "--cpu-bind", cores,
            "--kv-cache-gib", KV_CACHE_GIB, "--etcd", f"http://{self.etcd.endpoint}", "--registry-ttl", str(TTL),
            "--cluster-token-file", self.token_file],
            self.log_dir)
        self.workers[name] = proc
        return proc

    def start_conductor(self, *extra: str, port: int | None = None) -> Proc:
        return start(f"conductor-{port or self.port}", [
            "-m", "mooncake.cli", "conductor", "--model", self.model, "--served-model-name", MODEL_NAME,
            "--port", str(port or self.port), "--etcd", f"http://{self.etcd.endpoint}",
            # Fixed roles and no fetches between pools: these tests check prefix locality and failover
            # among the prefill workers, and an idle non-holder that fetches the prefix may price
            # lower than its holder. Flexible roles and fetches have their own tests (tests/core,
            # tests/spine, tests/e2e: test_flexible_roles.py, test_prefix_fetch.py).
            "--registry-ttl", str(TTL), "--no-flexible-roles", "--no-remote-fetch",
            "--cluster-token-file", self.token_file, *extra],
            self.log_dir)

    @property
    def internal_headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: open(self.token_file).read().strip()}

    def wait_cached(self, prompt: str, holder: str, blocks: int, port: int | None = None) -> None:
        """Until the conductor (at `port`, else A) places `blocks` of `prompt`'s prefix on `holder`."""
        wait_cached(f"http://127.0.0.1:{port or self.port}", self.internal_headers, prompt, holder, blocks)

    def health(self, port: int | None = None) -> dict:
        return httpx.get(f"http://127.0.0.1:{port or self.port}/health", timeout=5).json()

    def wait_ready(self, names: set[str], timeout_s: float = 400, port: int | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.workers.items():
                if name in names and not proc.alive():
                    raise RuntimeError(f"{name} died:\n{proc.log_tail()}")
            try:
                ready = {w["instance_id"] for w in self.health(port)["workers"] if w["status"] == "ready"}
                if names <= ready:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"not ready: {names}; health: {self.health(port)}")

    def stop(self) -> None:
        for proc in [*self.workers.values(), self.conductor]:
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="module")
def cluster(model_path, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("etcd-cluster")
    etcd = EtcdServer(workdir)
    etcd.start()
    c = EtcdCluster(etcd, model_path, workdir)
    try:
        # A generous TTFT SLO: these tests are about routing and failures on two shared cores;
        # refusals under the SLO have their own test with a strict conductor. Never prefilled on
        # the decode worker: it holds every prompt it decoded too (the KV pushed to it), so a
        # prompt whose uncached tail is short is rightly served there whichever prefill worker
        # holds its prefix (conditional disaggregation, tested in tests/core and tests/e2e).
        c.conductor = c.start_conductor("--ttft-slo", "600", "--no-conditional-disaggregation")
        for name in (*PREFILLS, "decode-a"):
            c.start_worker(name)
        wait_http(c.conductor, f"http://127.0.0.1:{c.port}/health", 400)
        c.wait_ready({*PREFILLS, "decode-a"})
        yield c
    finally:
        c.stop()
        etcd.kill()


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i % 97}" for i in range(n))


def complete(api: str, prompt: str, max_tokens: int = 4, timeout: float = 300) -> httpx.Response:
    return httpx.post(api + "/completions", timeout=timeout, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_shared_prefix_goes_to_the_prefill_instance_that_holds_it(cluster):
    prefix = "Shared system prompt. " + words(700, "ctx")
    first = complete(cluster.api, prefix + " Question one?")
    assert first.status_code == 200, first.text
    holder = first.headers["x-mooncake-prefill"]
    assert holder in PREFILLS
    # The holder's KV events reach the conductor's index within a few poll intervals.
    cluster.wait_cached(prefix, holder, 5)
    for i in range(3):
        resp = complete(cluster.api, prefix + f" Another question number {i}?")
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-mooncake-prefill"] == holder
        assert int(resp.headers["x-mooncake-cached-tokens"]) >= 128 * 5  # the prefix came from cache
        assert resp.headers["x-mooncake-decode"] == "decode-a"


def test_unrelated_requests_spread_by_load(cluster):
    prompts = [words(600, f"u{i}x") + f" {uuid.uuid4().hex}" for i in range(6)]
    with cf.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda p: complete(cluster.api, p), prompts))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    used = {r.headers["x-mooncake-prefill"] for r in responses}
    assert used == set(PREFILLS), used


def _traffic(api: str, n: int, tag: str) -> list[tuple[str, str]]:
    """n concurrent streamed requests; each ends as ('ok', prefill) or ('error', message)."""
    client = openai.OpenAI(base_url=api, api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> tuple[str, str]:
        try:
            raw = client.completions.with_raw_response.create(
                model=MODEL_NAME, prompt=words(150, f"{tag}{i}_") + uuid.uuid4().hex, max_tokens=24,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            text = "".join(c.choices[0].text for c in raw.parse() if c.choices)
            return ("ok" if text else "empty", raw.headers.get("x-mooncake-prefill", ""))
        except openai.APIError as exc:  # an error answer or an error event: fine, a hang is not
            return ("error", str(exc))

    with cf.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_killed_prefill_worker_stops_receiving_traffic_and_returns(cluster):
    victim = "prefill-a"
    with cf.ThreadPoolExecutor(1) as bg:
        running = bg.submit(_traffic, cluster.api, 6, "kill")
        time.sleep(4)
        cluster.workers[victim].stop(sig=signal.SIGKILL, grace_s=1)  # the whole process group, like a crash
        started = time.monotonic()
        outcomes = running.result(timeout=240)  # every request ended: none hung
    assert all(kind in ("ok", "error") for kind, _ in outcomes), outcomes
    # Within the lease TTL the dead instance is out of routing; after it, always.
    while time.monotonic() - started < TTL + 1:
        time.sleep(0.5)
    after = _traffic(cluster.api, 4, "after")
    assert all(kind == "ok" for kind, _ in after), after
    assert victim not in {prefill for _, prefill in after}
    assert victim not in {w["instance_id"] for w in cluster.health()["workers"]}

    cluster.start_worker(victim)
    cluster.wait_ready({victim})
    deadline = time.monotonic() + 120
    seen: set[str] = set()
    while victim not in seen and time.monotonic() < deadline:
        seen |= {prefill for kind, prefill in _traffic(cluster.api, 4, "back") if kind == "ok"}
    assert victim in seen, "the restarted worker never received traffic again"


def test_conductor_keeps_serving_through_an_etcd_restart(cluster):
    cluster.etcd.kill()
    try:
        time.sleep(1.5)
        during = _traffic(cluster.api, 3, "etcd-down")
        assert all(kind == "ok" for kind, _ in during), during
        assert cluster.health()["registry"]["outage_since"] is not None
    finally:
        cluster.etcd.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        reg = cluster.health()["registry"]
        if reg["outage_since"] is None and reg["instances"] == 3:
            break
        time.sleep(0.5)
    assert reg["outage_since"] is None and reg["instances"] == 3, reg
    after = _traffic(cluster.api, 3, "etcd-back")
    assert all(kind == "ok" for kind, _ in after), after


def test_request_no_instance_can_serve_within_slo_gets_429(cluster):
    port = free_port()
    strict = cluster.start_conductor("--ttft-slo", "0.05", "--refuse-unattainable", port=port)
    try:
        wait_http(strict, f"http://127.0.0.1:{port}/health", 120)
        alive = {name for name, proc in cluster.workers.items() if proc.alive()}
        cluster.wait_ready(alive, port=port)
        resp = complete(f"http://127.0.0.1:{port}/v1", words(1500, "slo"))
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["code"] == "ttft_slo"
        assert int(resp.headers["retry-after"]) >= 1
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'mooncake_rejections_total{reason="ttft_slo",slo_class="default"} 1' in metrics
    finally:
        strict.stop()
