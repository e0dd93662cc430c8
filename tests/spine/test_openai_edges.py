"""OpenAI request shapes that clients send and an audit found mishandled: stop strings inside a
chunk of several tokens, explicit nulls, text-like content parts, tool calls in the history,
and /tokenize bodies that used to reach a plain-text 500. Pieces without an engine; the real
path's shapes are tested in tests/e2e/test_openai_params.py and test_fuzz_api.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conductor.choices import Choice, LogprobsWanted
from conductor.logprobs import TokenText
from conductor.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from mooncake.protocol import GenerateChunk
from tests.spine.test_openai_params import LetterTokenizer

CHAT = [{"role": "user", "content": "x"}]


def answer(chunk_sizes: list[int], tokens: list[int], stops: list[str], chat: bool = False):
    """(text, tokens counted, logprobs' token count, finish) of one choice fed in chunks."""
    choice = Choice(0, LetterTokenizer(), stops, LogprobsWanted(chat, 0, TokenText(LetterTokenizer())))
    at = 0
    for size in chunk_sizes:
        ids = tokens[at:at + size]
        at += size
        last = at >= len(tokens)
        choice.push(GenerateChunk(ids, finish_reason="length" if last else None,
                                  logprobs=[[(t, -0.5, 1)] for t in ids]), [])
        if choice.done:
            break
    logged = len(choice.logprobs["content"] if chat else choice.logprobs["tokens"])
    return choice.text, choice.count, logged, choice.finish


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_string_ends_the_count_at_its_token_however_the_tokens_were_chunked(chat):
    tokens = list(range(10))  # "abcdefghij"
    one_by_one = answer([1] * 10, tokens, ["de"], chat)
    assert one_by_one == ("abc", 5, 5, "stop")  # d and e were generated; e completed the stop
    for sizes in ([3, 3, 4], [10], [2, 8], [4, 6], [5, 5]):
        assert answer(sizes, tokens, ["de"], chat) == one_by_one, sizes
    assert answer([10], tokens, [], chat) == ("abcdefghij", 10, 10, "length")  # no stop: one push


def test_a_stop_token_in_a_chunk_of_several_still_ends_without_its_text():
    choice = Choice(0, LetterTokenizer(), ["zz"])
    event = choice.push(GenerateChunk([0, 1, 2], finish_reason="stop", stop_reason=2), [])
    assert (event.text, event.finish, event.stop_reason, choice.count) == ("ab", "stop", 2, 3)


@pytest.mark.parametrize("request_type,fields", [(CompletionRequest, {"prompt": "a", "echo": None}),
                                                 (ChatCompletionRequest, {"messages": CHAT,
                                                                          "add_generation_prompt": None})])
def test_an_explicit_null_is_the_default(request_type, fields):
    body = request_type.model_validate({"model": "m", "stream": None, "n": None, "presence_penalty": None,
                                        "frequency_penalty": None, "min_tokens": None, "ignore_eos": None,
                                        "max_tokens": None, "temperature": None, **fields})
    assert (body.stream, body.n, body.presence_penalty, body.frequency_penalty, body.min_tokens, body.ignore_eos) == \
        (False, 1, 0.0, 0.0, 0, False)
    assert body.temperature is None and body.max_tokens is None  # nullable fields keep their null
    with pytest.raises(ValueError, match="n"):
        request_type.model_validate({"model": "m", "n": "two", **fields})  # a wrong value is still a 400


@pytest.mark.parametrize("part,text", [({"type": "text", "text": "a"}, "a"), ({"type": "input_text", "text": "b"}, "b"),
                                       ({"type": "output_text", "text": "c"}, "c"),
                                       ({"type": "refusal", "refusal": "I can't."}, "I can't."),
                                       ({"type": "thinking", "thinking": "hmm"}, "hmm")])
def test_text_like_content_parts_are_text(part, text):
    assert ChatMessage(role="assistant", content=[part, {"type": "text", "text": "z"}]).text() == f"{text}\nz"


def test_other_content_parts_are_still_named_as_unsupported():
    with pytest.raises(ValueError, match="'image_url' is not supported"):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}]).text()


def test_tool_call_arguments_reach_the_chat_template_as_objects():
    def call(arguments):
        return {"id": "c1", "type": "function", "function": {"name": "w", "arguments": arguments}}

    message = ChatMessage(role="assistant", content=None,
                          tool_calls=[call('{"city": "Paris"}'), call("not json"), call("[1]"), call(""),
                                      call({"k": 1})])
    rendered = message.for_template()
    assert [c["function"]["arguments"] for c in rendered["tool_calls"]] == [{"city": "Paris"}, {}, {}, {}, {"k": 1}]
    assert message.model_extra["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated
    assert "tool_calls" not in ChatMessage(role="assistant", content="a", tool_calls=[]).for_template()
    with pytest.raises(ValueError, match="type 'function'"):
        ChatMessage(role="assistant", content=None, tool_calls=[{"type": "code"}]).for_template()
    # A user message's fields are passed as they are (only an assistant's calls are history).
    assert ChatMessage(role="tool", content="sunny", tool_call_id="c1").for_template()["tool_call_id"] == "c1"


def conductor(tmp_path):
    from conductor.app import create_app
    from conductor.config import ConductorConfig

    return create_app(ConductorConfig(model_path=str(tmp_path), served_model_name="m"))  # no lifespan, no tokenizer


@pytest.mark.parametrize("content", [b'{"prompt": "\\ud800"}',
                                     b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                                     b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_tokenize_answers_bad_bodies_with_an_openai_400(tmp_path, content):
    async def run():
        transport = httpx.ASGITransport(app=conductor(tmp_path), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            return await c.post("/tokenize", content=content, headers={"content-type": "application/json"})

    resp = asyncio.run(run())
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_an_unexpected_failure_is_a_500_in_the_api_s_shape(tmp_path):
    app = conductor(tmp_path)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            return await c.get("/boom")

    resp = asyncio.run(run())
    assert resp.status_code == 500
    assert resp.json()["error"]["code"] == "internal_error" and "RuntimeError" in resp.json()["error"]["message"]
