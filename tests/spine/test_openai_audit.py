"""OpenAI API details an audit against vLLM's own server found diverging: continuous usage in a
stream is each choice's own (not the sum over all choices and prompts), chat's role chunks carry
it too, a body declared as something other than JSON is named as such, and a completion too long
for the context names the field the client set. Pieces without an engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conductor.batch import prepare_batch, serve_batch
from conductor.config import ConductorConfig
from conductor.errors import APIError
from conductor.schemas import ChatCompletionRequest
from conductor.serving import CompletionService
from tests.spine.test_batch import PerPromptRelay, batch_of
from tests.spine.test_lifecycle import PROMPT, Client, LetterTokenizer, drive
from tests.spine.test_openai_edges import conductor
from tests.spine.test_routing import pool_of, router


def events_of(client: Client) -> list[dict]:
    return [json.loads(line[6:]) for line in client.text().split("\n\n") if line.startswith("data: {")]


def test_continuous_usage_is_each_choice_s_own_as_vllm_reports_it():
    async def main():
        relay = PerPromptRelay(3, pause_s=0.001)
        from tests.spine.test_lifecycle import make_service

        service = make_service(relay)
        reqs = await prepare_batch(service, batch_of(2, max_tokens=3, n=2, stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True}), None)
        client = Client()
        await drive(await serve_batch(service, reqs, "completions"), client)
        events = events_of(client)
        counts: dict[int, list[int]] = {}
        for event in events[:-1]:
            (choice,) = event["choices"]
            usage = event["usage"]
            assert usage["prompt_tokens"] == len(PROMPT)  # its own prompt's, not the batch's
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            counts.setdefault(choice["index"], []).append(usage["completion_tokens"])
        # Each of the 4 choices counts 1, 2, 3 of its own tokens (was: the running sum to 12).
        assert counts == {i: [1, 2, 3] for i in range(4)}
        final = events[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
        assert final["usage"]["prompt_tokens"] == 2 * len(PROMPT)

    asyncio.run(main())


class ChatLetterTokenizer(LetterTokenizer):
    """A chat template that renders any conversation as `PROMPT`'s length of text."""

    def apply_chat_template(self, messages, **kwargs) -> str:
        return "x" * len(PROMPT)

    def encode(self, text, add_special_tokens=False) -> list[int]:
        return PROMPT[:len(text)]


def chat_service(relay) -> CompletionService:
    r = router(pool_of(("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")))
    return CompletionService(ConductorConfig(model_path="unused", served_model_name="m"), ChatLetterTokenizer(), r,
                             relay, r.metrics)


def test_chat_role_chunks_carry_continuous_usage_too():
    async def main():
        service = chat_service(PerPromptRelay(2, pause_s=0.001))
        req = await service.prepare(ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}))
        client = Client()
        await drive(await service.serve(req, "chat"), client)
        events = events_of(client)
        roles = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
        assert [e["choices"][0]["index"] for e in roles] == [0, 1]
        assert all(e["usage"]["prompt_tokens"] == len(PROMPT) and e["usage"]["completion_tokens"] == 0
                   for e in roles)
        tokens = [(e["choices"][0]["index"], e["usage"]["completion_tokens"]) for e in events
                  if e["choices"] and "role" not in e["choices"][0]["delta"]]
        assert sorted(tokens) == [(0, 1), (0, 2), (1, 1), (1, 2)]

    asyncio.run(main())


def test_without_continuous_usage_no_chunk_but_the_last_has_usage():
    async def main():
        service = chat_service(PerPromptRelay(2, pause_s=0.001))
        req = await service.prepare(ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True}))
        client = Client()
        await drive(await service.serve(req, "chat"), client)
        events = events_of(client)
        assert all("usage" not in e for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 2

    asyncio.run(main())


@pytest.mark.parametrize("fields,param", [({"max_completion_tokens": 10**6}, "max_completion_tokens"),
                                          ({"max_tokens": 10**6}, "max_tokens"),
                                          # both given: max_completion_tokens is the one used, as in vLLM
                                          ({"max_tokens": 5, "max_completion_tokens": 10**6}, "max_completion_tokens")])
def test_a_completion_too_long_for_the_context_names_the_field_set(fields, param):
    async def main():
        service = chat_service(PerPromptRelay(2))
        with pytest.raises(APIError) as info:
            await service.prepare(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                        **fields))
        assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", param)

    asyncio.run(main())


def post(tmp_path, content: bytes, content_type: str | None, path="/v1/completions") -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=conductor(tmp_path), raise_app_exceptions=False)
        headers = {} if content_type is None else {"content-type": content_type}
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            return await c.post(path, content=content, headers=headers)

    return asyncio.run(run())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                          None])
def test_a_body_declared_as_something_other_than_json_is_refused_by_its_type(tmp_path, path, content_type):
    # What `curl -d '{...}'` sends without -H, or a client that sends no type (FastAPI does not
    # read that as JSON either): the old answer, a 400 "Input should be a valid dictionary or
    # object", named neither the header nor the fix.
    resp = post(tmp_path, b'{"model": "m", "prompt": "a"}', content_type, path)
    assert resp.status_code == 415, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_bodies_still_reach_validation(tmp_path, content_type):
    # The body lacks its model: a 400 naming it shows the body was read as JSON.
    resp = post(tmp_path, b'{"prompt": "a"}', content_type)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "model"


@pytest.mark.parametrize("content", [b"[1, 2]", b'"a prompt"', b"3"])
def test_a_json_body_that_is_not_an_object_says_so(tmp_path, content):
    resp = post(tmp_path, content, "application/json")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"] == "the request body must be a JSON object"
