"""Every way an admitted request can end gives back everything it held, exactly once.

A real CompletionService and Router (the real scheduling core) with a scripted relay in place of
the workers; streamed answers are driven through their ASGI `__call__` with hand-made
receive/send, so a client can leave before the first byte or in the middle of the stream.
"""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from conductor.config import ConductorConfig
from conductor.errors import APIError
from conductor.lifecycle import LifeStreamingResponse
from conductor.schemas import CompletionRequest
from conductor.serving import CompletionService
from conductor.workers import EngineFailed, WorkerError
from mooncake.protocol import GenerateChunk
from tests.spine.test_routing import pool_of, router

PROMPT = list(range(1000, 3500))  # 2,500 tokens: disaggregated, with pending prefix blocks


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26)."""

    def __len__(self) -> int:
        return 50_000

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class ScriptedRelay:
    """Stands in for Relay: fails before the first token on the prefill instances in `fail_on`,
    else yields `tokens` one per chunk (the last with a finish reason), optionally failing after
    `error_after` chunks. Records whether each stream was closed before it finished."""

    def __init__(self, tokens, fail_on=(), error_after=None, pause_s=0.0, error=WorkerError):
        self.tokens = tokens
        self.error = error  # WorkerError: a worker died; EngineFailed: its engine ended the request with an error
        self.fail_on = set(fail_on)
        self.error_after = error_after
        self.pause_s = pause_s
        self.prefills: list[str] = []
        self.request_ids: list[str] = []
        self.closed_early = 0
        self.completed = 0

    async def run(self, request_id, prompt, sampling, route, stats):
        self.prefills.append(route.prefill.name)
        self.request_ids.append(request_id)
        if route.prefill.name in self.fail_on:
            raise self.error(f"{route.prefill.name} is down")
        chunks = self.stream(self.tokens, self.error_after)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def stream(self, tokens, error_after):
        """`tokens` one per chunk, failing as a dead worker after `error_after` of them."""
        done = False
        try:
            for i, token in enumerate(tokens):
                if error_after is not None and i == error_after:
                    raise self.error("decode worker died", started=True)
                last = i == len(tokens) - 1
                done = last  # the consumer stops pulling at the finish reason, as with a worker
                yield GenerateChunk([token], finish_reason="length" if last else None)
                await asyncio.sleep(self.pause_s)
        finally:
            if done:
                self.completed += 1
            else:
                self.closed_early += 1


def make_service(relay, specs=(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"))):
    pool = pool_of(*specs)
    r = router(pool)
    config = ConductorConfig(model_path="unused", served_model_name="m")
    return CompletionService(config, LetterTokenizer(), r, relay, r.metrics)


async def prepared(service, **body):
    return await service.prepare(CompletionRequest(model="m", prompt=PROMPT, **body))


def assert_all_released(service, status: str, endpoint: str = "completions", first_token: bool = True):
    snap = service.snapshot()
    assert snap["in_flight"] == 0 and snap["pending_prefix_entries"] == 0, snap
    assert all(n == 0 for ledger in snap["ledgers"].values() for n in ledger.values()), snap
    m = service.metrics
    answered = [s.labels["status"] for fam in m.registry.collect() if fam.name == "mooncake_requests"
                for s in fam.samples if s.name == "mooncake_requests_total" for _ in range(int(s.value))]
    assert answered == [status], answered  # counted once, with its outcome
    assert m.value("mooncake_request_latency_seconds_count", slo_class="default") == (1 if first_token else 0)


class Client:
    """The ASGI side of one streamed response: collects the body, and leaves when told to."""

    def __init__(self, leave_after_bodies=None, spec="2.4"):
        self.leave_after_bodies = leave_after_bodies
        self.spec = spec
        self.messages: list[dict] = []
        self.left = asyncio.Event()

    @property
    def scope(self):
        return {"type": "http", "asgi": {"spec_version": self.spec}}

    async def receive(self):
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        bodies = sum(1 for m in self.messages if m["type"] == "http.response.body")
        if self.leave_after_bodies is not None and bodies >= self.leave_after_bodies:
            self.left.set()
            if self.spec >= "2.4":
                raise OSError("client went away")  # what a 2.4 server's send does after a disconnect
            await asyncio.sleep(3600)  # a 2.3 server: the disconnect arrives through receive()
        self.messages.append(message)

    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body").decode()


async def drive(response, client: Client):
    try:
        await response(client.scope, client.receive, client.send)
    except ClientDisconnect:
        assert client.left.is_set()


def test_success_non_streamed_releases_once():
    async def main():
        relay = ScriptedRelay(list(range(8)))
        service = make_service(relay)
        req = await prepared(service, max_tokens=8)
        response = await service.serve(req, "completions")
        assert response.status_code == 200 and b'"text": "abcdefgh"' in response.body.replace(b'":"', b'": "')
        assert relay.completed == 1 and relay.prefills in (["p1"], ["p2"])
        assert_all_released(service, "200")

    asyncio.run(main())


def test_success_streamed_releases_once_after_the_last_byte():
    async def main():
        relay = ScriptedRelay(list(range(6)))
        service = make_service(relay)
        req = await prepared(service, max_tokens=6, stream=True)
        response = await service.serve(req, "completions")
        assert isinstance(response, LifeStreamingResponse)
        assert service.in_flight == 1  # held by the response until it has been sent
        client = Client()
        await drive(response, client)
        assert "data: [DONE]" in client.text() and relay.completed == 1
        assert_all_released(service, "200")

    asyncio.run(main())


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_client_gone_before_the_first_byte_releases_although_the_body_never_started(spec):
    async def main():
        relay = ScriptedRelay(list(range(50)))
        service = make_service(relay)
        req = await prepared(service, max_tokens=50, stream=True)
        response = await service.serve(req, "completions")
        await drive(response, Client(leave_after_bodies=0, spec=spec))
        assert relay.closed_early == 1  # the workers' stream was closed: their requests are aborted
        assert_all_released(service, "499")

    asyncio.run(main())


def test_response_start_refused_releases_too():
    """The server cannot even send the headers: the body iterator is never touched."""
    async def main():
        relay = ScriptedRelay(list(range(50)))
        service = make_service(relay)
        req = await prepared(service, max_tokens=50, stream=True)
        response = await service.serve(req, "completions")

        async def send(message):
            raise OSError("connection reset")

        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
        assert relay.closed_early == 1
        assert_all_released(service, "499")

    asyncio.run(main())


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_client_gone_mid_stream_releases_and_aborts_the_workers(spec):
    async def main():
        relay = ScriptedRelay(list(range(500)), pause_s=0.001)
        service = make_service(relay)
        req = await prepared(service, max_tokens=500, stream=True)
        response = await service.serve(req, "completions")
        client = Client(leave_after_bodies=5, spec=spec)
        await asyncio.wait_for(drive(response, client), timeout=10)
        assert "[DONE]" not in client.text() and relay.closed_early == 1 and relay.completed == 0
        assert_all_released(service, "499")

    asyncio.run(main())


def test_handler_cancelled_while_collecting_a_non_streamed_answer_releases():
    async def main():
        relay = ScriptedRelay(list(range(500)), pause_s=0.001)
        service = make_service(relay)
        req = await prepared(service, max_tokens=500)
        task = asyncio.create_task(service.serve(req, "completions"))
        while service.metrics.value("mooncake_generated_tokens_total") < 5:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert relay.closed_early == 1
        assert_all_released(service, "499")

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_request_aborts_the_workers_and_releases(stream):
    async def main():
        relay = ScriptedRelay(list(range(26)) * 4)
        service = make_service(relay)
        req = await prepared(service, max_tokens=104, stop=["fg"], stream=stream)
        response = await service.serve(req, "completions")
        if stream:
            client = Client()
            await drive(response, client)
            body = client.text()
        else:
            body = response.body.decode()
        body = body.replace('":"', '": "')
        assert '"finish_reason": "stop"' in body and '"stop_reason": "fg"' in body
        assert "fg" not in body.replace('"stop_reason": "fg"', "")  # the text ends before it
        assert relay.closed_early == 1
        assert_all_released(service, "200")

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_worker_failure_mid_request_releases_with_502(stream):
    async def main():
        relay = ScriptedRelay(list(range(20)), error_after=3)
        service = make_service(relay)
        req = await prepared(service, max_tokens=20, stream=stream)
        if stream:
            response = await service.serve(req, "completions")
            client = Client()
            await drive(response, client)
            assert "worker_failed" in client.text()
        else:
            with pytest.raises(APIError) as info:
                await service.serve(req, "completions")
            assert info.value.status == 502
        assert_all_released(service, "502")

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_error_mid_request_is_a_500_not_an_answer_that_ends_in_error(stream):
    # vLLM's finish_reason "error" (its grammar rejected a token...): its server answers 500.
    async def main():
        relay = ScriptedRelay(list(range(20)), error_after=3, error=EngineFailed)
        service = make_service(relay)
        req = await prepared(service, max_tokens=20, stream=stream)
        if stream:
            response = await service.serve(req, "completions")
            client = Client()
            await drive(response, client)
            assert "engine_error" in client.text() and '"finish_reason": "error"' not in client.text()
        else:
            with pytest.raises(APIError) as info:
                await service.serve(req, "completions")
            assert info.value.status == 500 and info.value.code == "engine_error"
        assert_all_released(service, "500")

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_shutdown_mid_answer_ends_it_with_a_503_error_not_a_cut(stream):
    # Ctrl-C, or a drain's grace over (conductor.app.close_streams): the answer ends at its next
    # token with an error the client can tell from a whole answer, and everything is released.
    async def main():
        relay = ScriptedRelay(list(range(200)), pause_s=0.01)
        service = make_service(relay)
        req = await prepared(service, max_tokens=200, stream=stream)

        async def close_soon():
            await asyncio.sleep(0.2)
            service.closing = True

        closer = asyncio.create_task(close_soon())
        if stream:
            response = await service.serve(req, "completions")
            client = Client()
            await drive(response, client)
            text = client.text()
            assert "server_shutting_down" in text and text.rstrip().endswith("data: [DONE]")
            assert '"finish_reason": "length"' not in text.replace('":"', '": "')
        else:
            with pytest.raises(APIError) as info:
                await service.serve(req, "completions")
            assert info.value.status == 503 and info.value.code == "server_shutting_down"
        await closer
        assert relay.closed_early == 1 and relay.completed == 0
        assert_all_released(service, "503")

    asyncio.run(main())


def test_refused_at_admission_holds_nothing_and_is_counted_once():
    async def main():
        service = make_service(ScriptedRelay([1]), specs=(("p1", "prefill"),))  # no decode worker
        req = await prepared(service, max_tokens=1)
        with pytest.raises(APIError) as info:
            await service.serve(req, "completions")
        assert info.value.status == 503
        assert_all_released(service, "503", first_token=False)

    asyncio.run(main())


def test_time_between_tokens_is_measured_within_each_sample():
    class Interleaved:
        """Two samples whose chunks alternate, one clock second apart."""

        def __init__(self, clock):
            self.clock = clock

        async def samples(self, request_id, prompt, sampling, route, stats, n, stopped=None):
            for i, index in enumerate((0, 1, 0, 1, 0, 1)):
                self.clock[0] += 1.0
                yield index, GenerateChunk([5], finish_reason="length" if i >= 4 else None)

    async def main():
        now = [0.0]
        service = make_service(Interleaved(now))
        service.clock = lambda: now[0]
        await service.serve(await prepared(service, max_tokens=3, n=2), "completions")
        m = service.metrics
        # Sample 0 at t=1, 3, 5 and sample 1 at t=2, 4, 6: four gaps of 2 s (not five of 1 s).
        assert m.value("mooncake_time_between_tokens_seconds_count", slo_class="default") == 4
        assert m.value("mooncake_time_between_tokens_seconds_sum", slo_class="default") == 8.0
    asyncio.run(main())


def test_min_tokens_above_max_tokens_is_refused_as_vllm_does():
    # It was clamped to max_tokens; vLLM's SamplingParams answers 400.
    async def main():
        service = make_service(ScriptedRelay([1]))
        with pytest.raises(APIError) as info:
            await prepared(service, max_tokens=5, min_tokens=10)
        assert info.value.status == 400 and info.value.param == "min_tokens"
        assert "min_tokens must be less than or equal to max_tokens=5, got 10" in info.value.message
        assert (await prepared(service, max_tokens=5, min_tokens=5)).sampling.min_tokens == 5

    asyncio.run(main())


class LowercaseTokenizer(LetterTokenizer):
    """Writes a-z only: anything else becomes U+FFFD, as a byte-level vocabulary that lacks bytes."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 97 if "a" <= c <= "z" else 9999 for c in text]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i) if i < 26 else "\ufffd" for i in ids)


@pytest.mark.parametrize("fields", [{"guided_choice": ["yes", "n\U00040000"]},
                                    {"structured_outputs": {"choice": ["n\U00040000"]}}])
def test_a_choice_the_tokenizer_cannot_write_is_a_400_not_an_engine_error(fields):
    # The grammar cannot be met (found live: SmolLM2 lacks the bytes of Unicode planes 4-13), and
    # vLLM's engine then samples a token its grammar rejects: a 500 from stock vLLM.
    async def main():
        relay = ScriptedRelay([1])
        service = make_service(relay)
        service.tokenizer = LowercaseTokenizer()
        with pytest.raises(APIError) as info:
            await prepared(service, max_tokens=2, **fields)
        assert info.value.status == 400 and info.value.param == next(iter(fields))
        assert repr("n\U00040000") in info.value.message and relay.prefills == []
        assert (await prepared(service, max_tokens=2, guided_choice=["yes", "no"])).sampling.structured

    asyncio.run(main())
