"""Two conductor replicas in front of the same workers and etcd (docs/DEPLOY.md, "Several
conductors"): etcd, two prefill workers, one decode worker, and conductors A and B, each its own
process. One cluster serves the module; every test starts by waiting until both replicas see all
three workers ready, and puts back what it stopped, so the tests hold in any order.

- Both replicas route by the same prefix index, learned from the workers' KV events: a prefix
  cached through one replica is found through the other.
- SIGKILL replica A while streams are in flight on B: every stream on B ends with the text of a
  baseline, B keeps serving, the workers let go of A's abandoned requests, and a restarted A
  rebuilds the same index from etcd and the workers.
- SIGTERM a prefill worker with a prefill in flight: it finishes that request, leaves etcd at once
  (not at its lease's end), and neither replica routes to it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest

from tests.cluster.test_etcd_cluster import PREFILLS, EtcdCluster, complete, words
from tests.conftest import MODEL_NAME
from tests.etcd_server import EtcdServer
from tests.processes import Proc, free_port, wait_http

pytestmark = [pytest.mark.vllm, pytest.mark.etcd]
WORKERS = {*PREFILLS, "decode-a"}
CACHED = 5 * 128  # a shared prefix of at least five blocks came from the prefill worker's cache


class Replicas(EtcdCluster):
    """EtcdCluster with a second conductor, B; `conductor` and `port` are replica A."""

    def __init__(self, etcd: EtcdServer, model: str, log_dir):
        super().__init__(etcd, model, log_dir)
        self.port_b = free_port()
        self.conductor_b: Proc | None = None

    def running_on(self, worker_port: int) -> int:
        """Requests in the worker's engine now (its internal API asks for the cluster token)."""
        resp = httpx.get(f"http://127.0.0.1:{worker_port}/internal/load", timeout=5, headers=self.internal_headers)
        assert resp.status_code == 200, resp.text
        return resp.json()["running_requests"]

    def start_replica(self, port: int) -> Proc:
        # A generous TTFT SLO: these tests are about routing and failures on two shared cores.
        # Never prefilled on the decode worker: it holds every prompt it decoded too, and a prompt
        # whose uncached tail fits one step would be served there, whichever prefill worker holds it.
        # The default policy (kvcache-centric), without fetches between pools (start_conductor):
        # the holder is the cheapest choice.
        proc = self.start_conductor("--ttft-slo", "600", "--no-conditional-disaggregation", port=port)
        if port == self.port:
            self.conductor = proc
        else:
            self.conductor_b = proc
        return proc

    def api_of(self, port: int) -> str:
        return f"http://127.0.0.1:{port}/v1"

    def wait_all(self) -> None:
        """Both replicas up and seeing every worker ready (whatever an earlier test stopped)."""
        for port, proc in ((self.port, self.conductor), (self.port_b, self.conductor_b)):
            wait_http(proc, f"http://127.0.0.1:{port}/health", 120)
            self.wait_ready(WORKERS, port=port)

    def index_blocks(self, port: int) -> int:
        return self.health(port)["prefix_index_blocks"]

    def wait_same_index(self, at_least: int, timeout_s: float = 10) -> int:
        """Both replicas' prefix indexes hold the same number of blocks (>= at_least)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            a, b = self.index_blocks(self.port), self.index_blocks(self.port_b)
            if a == b >= at_least:
                return a
            time.sleep(0.25)
        raise AssertionError(f"prefix indexes differ: A {a} blocks, B {b} blocks (want >= {at_least})")

    def stop(self) -> None:
        """All at once (each drains on SIGTERM; one by one they would wait for each other)."""
        procs = [p for p in (*self.workers.values(), self.conductor, self.conductor_b) if p is not None and p.alive()]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in procs:
            proc.stop(grace_s=max(0.1, deadline - time.monotonic()))  # waits, then SIGKILLs the group


@pytest.fixture(scope="module")
def replicas(model_path, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replicas")
    etcd = EtcdServer(workdir)
    etcd.start()
    c = Replicas(etcd, model_path, workdir)
    try:
        c.start_replica(c.port)
        c.start_replica(c.port_b)
        for name in sorted(WORKERS):
            c.start_worker(name)
        c.wait_all()
        yield c
    finally:
        c.stop()
        etcd.kill()


def _cache_through(api: str, prefix: str) -> str:
    """Send a prompt with `prefix`; the prefill worker that now holds it."""
    resp = complete(api, prefix + f" First question {uuid.uuid4().hex[:6]}?")
    assert resp.status_code == 200, resp.text
    return resp.headers["x-mooncake-prefill"]


def test_both_replicas_route_a_prefix_to_the_worker_that_holds_it(replicas):
    replicas.wait_all()
    a, b = replicas.api_of(replicas.port), replicas.api_of(replicas.port_b)
    # Prefix one is cached through A, prefix two through B; each is then asked of the other replica,
    # which never routed it and knows where it lives only from the holder's KV events.
    for tag, first, other in (("one", a, b), ("two", b, a)):
        prefix = f"Shared prompt {tag} {uuid.uuid4().hex}. " + words(400, f"{tag}x")
        holder = _cache_through(first, prefix)
        assert holder in PREFILLS
        for port in (replicas.port, replicas.port_b):  # asked by its blocks: others may leave the index
            replicas.wait_cached(prefix, holder, CACHED // 128, port=port)
        for i in range(2):
            resp = complete(other, prefix + f" Follow-up number {i}?")
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-mooncake-prefill"] == holder, (tag, resp.headers)
            assert int(resp.headers["x-mooncake-cached-tokens"]) >= CACHED, resp.headers


def _stream(client: openai.OpenAI, prompt: str, max_tokens: int, started: threading.Event, log: list) -> str:
    """One streamed greedy completion; sets `started` at its first text, appends "done" at its end."""
    text = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
            started.set()
    log.append("done")
    return "".join(text)


def test_killing_one_replica_loses_no_request_sent_to_the_other(replicas):
    replicas.wait_all()
    a, b = replicas.api_of(replicas.port), replicas.api_of(replicas.port_b)
    prompts = [words(120, f"k{i}_") + f" {uuid.uuid4().hex}" for i in range(4)]
    max_tokens = 160  # long enough to be mid-stream when A dies, even with all four decoding at once
    baseline_client = openai.OpenAI(base_url=a, api_key="x", max_retries=0, timeout=300)
    with cf.ThreadPoolExecutor(4) as pool:
        baseline = list(pool.map(lambda p: baseline_client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True}).choices[0].text, prompts))

    client_b = openai.OpenAI(base_url=b, api_key="x", max_retries=0, timeout=300)
    client_a = openai.OpenAI(base_url=a, api_key="x", max_retries=0, timeout=300)
    on_b = [threading.Event() for _ in prompts]
    on_a = [threading.Event() for _ in range(2)]
    finished_b: list[str] = []
    try:
        with cf.ThreadPoolExecutor(6) as pool:
            # A's own streams start first and are long: they must still be running when A dies. B's start
            # after them, so the kill follows B's first tokens at once (started the other way round, B's
            # short streams could all end while A's waited for their first token).
            streams_a = [pool.submit(_stream, client_a, words(120, f"a{i}_") + uuid.uuid4().hex, 400, ev, [])
                         for i, ev in enumerate(on_a)]
            for ev in on_a:
                assert ev.wait(240), "a stream on A never started"
            streams_b = [pool.submit(_stream, client_b, p, max_tokens, ev, finished_b) for p, ev in zip(prompts, on_b)]
            for ev in on_b:
                assert ev.wait(240), "a stream on B never started"
            done_at_kill = len(finished_b)
            replicas.conductor.stop(sig=signal.SIGKILL, grace_s=1)  # replica A crashes mid-stream
            texts = [s.result(timeout=240) for s in streams_b]
            for s in streams_a:  # A's own clients see an error, never a hang
                with pytest.raises(Exception):
                    s.result(timeout=60)
        assert done_at_kill < len(prompts), "every stream on B had ended before the kill: nothing was tested"
        assert texts == baseline  # every request sent to B completed, token for token

        resp = client_b.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert resp.choices[0].message.content
        # The workers let go of what A had sent them (the dropped connections abort those requests).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = {n: replicas.running_on(p) for n, p in replicas.worker_ports.items()}
            if not any(running.values()):
                break
            time.sleep(0.5)
        assert not any(running.values()), running
    finally:
        # A restarted replica rebuilds its view from etcd and its prefix index from the workers.
        replicas.start_replica(replicas.port)
    replicas.wait_all()
    replicas.wait_same_index(1)


def test_a_drained_worker_finishes_its_request_and_leaves_both_replicas(replicas):
    replicas.wait_all()
    a, b = replicas.api_of(replicas.port), replicas.api_of(replicas.port_b)
    prefix = f"Drain test prompt {uuid.uuid4().hex}. " + words(400, "dr")
    _cache_through(a, prefix)  # B will most likely route the next one to this prefix's holder
    replicas.wait_same_index(1)
    long_prompt = prefix + " " + words(400, f"tail{uuid.uuid4().hex[:4]}_")  # ~1,200 tokens to compute
    # The victim is whichever prefill worker takes the request: usually the holder, but B's
    # calibration may have measured the other one faster by more than the cached prefix saves.
    victim = None
    try:
        with cf.ThreadPoolExecutor(1) as bg:
            in_flight = bg.submit(complete, b, long_prompt, 8)
            deadline = time.monotonic() + 60
            while victim is None:
                assert time.monotonic() < deadline and not in_flight.done(), "the request never reached a prefill worker"
                victim = next((p for p in PREFILLS if replicas.running_on(replicas.worker_ports[p]) > 0), None)
                if victim is None:
                    time.sleep(0.05)
            survivor = next(p for p in PREFILLS if p != victim)
            proc, port = replicas.workers[victim], replicas.worker_ports[victim]
            os.kill(proc.process.pid, signal.SIGTERM)  # the main process only, as an orchestrator does
            terminated = time.monotonic()
            time.sleep(0.3)
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "draining", health.text
            # It left etcd at once: both replicas drop it well before its lease (TTL 4 s) could expire.
            for replica in (replicas.port, replicas.port_b):
                while victim in {w["instance_id"] for w in replicas.health(replica)["workers"]}:
                    assert time.monotonic() - terminated < 3.5, replicas.health(replica)
                    time.sleep(0.1)
            answer = in_flight.result(timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-mooncake-prefill"] == victim  # finished where it was, not retried
        assert proc.process.wait(timeout=60) == 0  # then it exited by itself
        for api in (a, b):  # the victim is gone: both replicas route it to the survivor
            again = complete(api, long_prompt, 8)
            assert again.status_code == 200 and again.headers["x-mooncake-prefill"] == survivor, again.headers
            assert again.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replicas.workers[victim].process.pid, signal.SIGKILL)  # its engine processes too
            replicas.start_worker(victim)  # back for the other tests; they wait until it is ready
