"""A completions request with several prompts (conductor/batch.py), without an engine: each prompt
a request of its own, answered as one body or one stream numbered as vLLM numbers it, and every
way it ends gives back everything every prompt held. The real path, against stock vLLM, is in
tests/e2e/test_openai_params.py."""

import asyncio
import json

import pytest

from conductor.batch import prepare_batch, serve_batch
from conductor.errors import APIError
from conductor.schemas import CompletionRequest
from conductor.merge import merged
from conductor.workers import WorkerError
from mooncake.protocol import GenerateChunk
from tests.spine.test_lifecycle import PROMPT, Client, ScriptedRelay, drive, make_service


class PerPromptRelay(ScriptedRelay):
    """Prompt k (its first token id is 1000 + k) generates tokens k, k, ... (letter k); the
    prompts whose k is in `fail_before` fail before their first token on every worker, those in
    `fail_after` after one token."""

    def __init__(self, tokens_each, fail_before=(), fail_after=(), pause_s=0.0):
        super().__init__([], pause_s=pause_s)
        self.tokens_each, self.fail_before, self.fail_after = tokens_each, set(fail_before), set(fail_after)
        self.started: list[int] = []

    async def run(self, request_id, prompt, sampling, route, stats):
        k = prompt[0] - 1000
        self.started.append(k)
        if k in self.fail_before:
            raise WorkerError(f"prompt {k} cannot run")
        chunks = self.stream([k] * self.tokens_each, 1 if k in self.fail_after else None)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def samples(self, request_id, prompt, sampling, route, stats, n, stopped=None):
        """n samples of the prompt, their chunks in turn (as the relay interleaves them)."""
        runs = [self.run(request_id, prompt, sampling, route, stats) for _ in range(n)]
        try:
            for _ in range(self.tokens_each):
                for j, run in enumerate(runs):
                    yield j, await anext(run)
        finally:
            for run in runs:
                await run.aclose()


def batch_of(count: int, **fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt=[[1000 + k] + PROMPT[1:] for k in range(count)], **fields)


def answered(service) -> list[str]:
    return sorted(s.labels["status"] for fam in service.metrics.registry.collect() if fam.name == "mooncake_requests"
                  for s in fam.samples if s.name == "mooncake_requests_total" for _ in range(int(s.value)))


def assert_nothing_held(service) -> None:
    snap = service.snapshot()
    assert snap["in_flight"] == 0 and snap["pending_prefix_entries"] == 0, snap
    assert all(n == 0 for ledger in snap["ledgers"].values() for n in ledger.values()), snap


def test_prompts_of_every_shape():
    assert CompletionRequest(model="m", prompt="a").prompts() == ["a"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    assert CompletionRequest(model="m", prompt=[]).prompts() == [[]]  # refused later as empty


def test_a_non_streamed_batch_numbers_choices_by_prompt_then_sample_and_sums_usage():
    async def main():
        relay = PerPromptRelay(3)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(3, max_tokens=3, n=2), None)
        response = await serve_batch(service, reqs, "completions")
        body = json.loads(response.body)
        assert [c["index"] for c in body["choices"]] == list(range(6))
        assert [c["text"] for c in body["choices"]] == ["aaa", "aaa", "bbb", "bbb", "ccc", "ccc"]
        assert body["usage"]["prompt_tokens"] == 3 * len(PROMPT) and body["usage"]["completion_tokens"] == 18
        assert body["id"].startswith("cmpl-") and len(response.headers["x-mooncake-prefill"].split(",")) == 3
        assert sorted(relay.started) == [0, 0, 1, 1, 2, 2]  # each prompt its own request, of 2 samples
        assert_nothing_held(service)
        assert answered(service) == ["200"] * 3

    asyncio.run(main())


def test_a_streamed_batch_interleaves_the_prompts_and_ends_with_their_summed_usage():
    async def main():
        relay = PerPromptRelay(4, pause_s=0.001)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(2, max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}), None)
        response = await serve_batch(service, reqs, "completions")
        assert service.in_flight == 2  # held by the response until it has been sent
        client = Client()
        await drive(response, client)
        events = [json.loads(line[6:]) for line in client.text().split("\n\n") if line.startswith("data: {")]
        texts: dict[int, str] = {}
        for event in events:
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert texts == {0: "aaaa", 1: "bbbb"}
        assert len({e["id"] for e in events}) == 1
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
        assert client.text().endswith("data: [DONE]\n\n")
        assert_nothing_held(service)
        assert answered(service) == ["200", "200"]

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_failing_before_its_first_token_fails_the_batch_and_cancels_the_others(stream):
    async def main():
        relay = PerPromptRelay(200, fail_before={1}, pause_s=0.001)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(3, max_tokens=200, stream=stream), None)
        with pytest.raises(APIError) as info:
            await serve_batch(service, reqs, "completions")
        assert info.value.status == 503
        assert relay.completed == 0  # nothing generated on for nobody
        assert_nothing_held(service)
        assert answered(service) == ["503"] * 3  # the batch's answer, for every prompt in it

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_dying_mid_answer_fails_the_batch_with_502_and_releases_all(stream):
    async def main():
        relay = PerPromptRelay(50, fail_after={0}, pause_s=0.001)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(2, max_tokens=50, stream=stream), None)
        if stream:
            client = Client()
            await drive(await serve_batch(service, reqs, "completions"), client)
            assert "worker_failed" in client.text() and client.text().endswith("data: [DONE]\n\n")
        else:
            with pytest.raises(APIError) as info:
                await serve_batch(service, reqs, "completions")
            assert info.value.status == 502
        assert_nothing_held(service)
        assert answered(service) == ["502", "502"]

    asyncio.run(main())


def test_a_client_leaving_a_streamed_batch_aborts_every_prompt():
    async def main():
        relay = PerPromptRelay(500, pause_s=0.001)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(3, max_tokens=500, stream=True), None)
        response = await serve_batch(service, reqs, "completions")
        await asyncio.wait_for(drive(response, Client(leave_after_bodies=5)), timeout=10)
        assert relay.closed_early == 3 and relay.completed == 0
        assert_nothing_held(service)
        assert answered(service) == ["499"] * 3

    asyncio.run(main())


class UnevenRelay(PerPromptRelay):
    """Prompt 0's worker streams fast, the others' slowly."""

    async def stream(self, tokens, error_after):
        done = False
        try:
            for i, token in enumerate(tokens):
                done = i == len(tokens) - 1
                yield GenerateChunk([token], finish_reason="length" if done else None)
                await asyncio.sleep(0.001 if tokens[0] == 0 else 0.5)
        finally:
            if done:
                self.completed += 1
            else:
                self.closed_early += 1


def test_a_client_leaving_a_batch_whose_prompts_stream_unevenly_aborts_every_prompt_at_once():
    """The merge was left to the garbage collector: its read of the slow prompt's stream was
    still pending, so that life's release failed ('aclose(): asynchronous generator is already
    running') and the slow prompt's worker kept generating."""
    async def main():
        relay = UnevenRelay(500)
        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(2, max_tokens=500, stream=True), None)
        response = await serve_batch(service, reqs, "completions")
        await asyncio.wait_for(drive(response, Client(leave_after_bodies=8)), timeout=10)
        assert relay.closed_early == 2 and relay.completed == 0
        assert_nothing_held(service)
        assert answered(service) == ["499"] * 2

    asyncio.run(main())


def test_a_bad_prompt_is_named_and_nothing_is_admitted():
    async def main():
        service = make_service(PerPromptRelay(1))
        body = CompletionRequest(model="m", prompt=[[1000], [1001, 10**9]], max_tokens=1)
        with pytest.raises(APIError) as info:
            await prepare_batch(service, body, None)
        assert info.value.status == 400 and info.value.message.startswith("prompt 1: ")
        service.config = service.config.__class__(**{**service.config.__dict__, "max_in_flight": 2})
        with pytest.raises(APIError, match="batch of 3 prompts exceeds"):
            await prepare_batch(service, batch_of(3), None)
        assert service.in_flight == 0 and answered(service) == []

    asyncio.run(main())


def test_merged_streams_yield_each_event_once_with_its_stream_and_stop_cleanly():
    async def stream(tag, count, pause):
        for i in range(count):
            await asyncio.sleep(pause)
            yield f"{tag}{i}"

    async def main():
        got = [item async for item in merged([stream("a", 3, 0.002), stream("b", 5, 0.001)])]
        assert sorted(got) == sorted([(0, "a0"), (0, "a1"), (0, "a2")] + [(1, f"b{i}") for i in range(5)])
        assert [e for k, e in got if k == 0] == ["a0", "a1", "a2"]  # each stream's own order kept
        closed = merged([stream("a", 100, 0.001), stream("b", 100, 0.001)])
        assert (await anext(closed))[1] in ("a0", "b0")
        await closed.aclose()  # the other stream's pending read is cancelled, not left running
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(main())
