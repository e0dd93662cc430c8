"""Requests to prompt token ids (conductor/prompts.py), piece by piece with a recording tokenizer.
The real tokenizer and template, against stock vLLM's /tokenize and chat answers, are tested in
tests/e2e/test_openai_params.py."""

import pytest
from pydantic import ValidationError

from conductor.errors import APIError
from conductor.prompts import (chat_prompt_ids, completion_prompt_ids, detokenize_body, prefix_request_ids, tokenize_body,
                               tokenize_request)
from conductor.schemas import ChatCompletionRequest, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]


class RecordingTokenizer:
    """Renders messages as 'role:content|' (plus '>' for a generation prompt) and encodes each
    character as its code point, a special 1 first when asked."""

    def __init__(self):
        self.template_calls = []

    def __len__(self):
        return 1000

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, continue_final_message=False,
                            tokenize=True, **variables):
        self.template_calls.append(dict(add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=tokenize, **variables))
        text = "".join(f"{m['role']}:{m['content']}|" for m in messages)
        return text[:-1] if continue_final_message else text + (">" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]


def chat_body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, **fields)


def test_chat_options_reach_the_template_and_the_encoding():
    tok = RecordingTokenizer()
    default = chat_prompt_ids(tok, chat_body().messages, None, chat_body())
    assert tok.decode(default) == "user:hi|assistant:he|>"  # rendered, then encoded without specials
    body = chat_body(add_generation_prompt=False, continue_final_message=True, add_special_tokens=True,
                     chat_template_kwargs={"enable_thinking": False})
    continued = chat_prompt_ids(tok, body.messages, None, body)
    assert continued[0] == 1 and tok.decode(continued[1:]) == "user:hi|assistant:he"
    assert tok.template_calls[-1] == {"add_generation_prompt": False, "continue_final_message": True,
                                      "tokenize": False, "enable_thinking": False}


def test_chat_options_that_cannot_be_honoured_are_refused():
    with pytest.raises(ValidationError, match="cannot both be true"):
        chat_body(continue_final_message=True)  # add_generation_prompt defaults to true, as in vLLM
    assert chat_body(chat_template="{{ x }}").unsupported_option()[0] == "chat_template"
    tok = RecordingTokenizer()
    for variables in ({"tokenize": True}, {"messages": []}, {"add_generation_prompt": False}):
        body = chat_body(chat_template_kwargs=variables)
        with pytest.raises(APIError) as info:
            chat_prompt_ids(tok, body.messages, None, body)
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs"
    assert tok.template_calls == []  # refused before the template ran


def test_tool_calls_ids_and_names_in_the_history_reach_the_template():
    # As vLLM: dropped, an assistant turn that called a tool rendered as an empty message and the
    # tool's answer with no id.
    seen = []

    class Capturing(RecordingTokenizer):
        def apply_chat_template(self, messages, **kw):
            seen.extend(messages)
            return super().apply_chat_template(messages, **kw)

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "q", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    chat_prompt_ids(Capturing(), body.messages, None, body)
    assert seen == [{"role": "user", "content": "q", "name": "alice"},
                    # The arguments parsed, as vLLM hands them to templates (their `| tojson`).
                    {"role": "assistant", "content": "",
                     "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1"}]


@pytest.mark.parametrize("field, value", [("use_beam_search", True), ("length_penalty", 0.5),
                                          ("return_tokens_as_token_ids", True), ("reasoning_effort", "none"),
                                          ("documents", [{"text": "d"}]), ("logprob_token_ids", [1])])
def test_vllm_fields_that_change_the_answer_are_refused_not_ignored(field, value):
    assert chat_body(**{field: value}).unsupported_option()[0] == field
    assert chat_body(**{field: None if field != "length_penalty" else 1.0}).unsupported_option() is None


def test_completion_prompts_with_and_without_special_tokens():
    tok = RecordingTokenizer()
    assert completion_prompt_ids(tok, "ab") == [1, 97, 98]
    assert completion_prompt_ids(tok, "ab", add_special_tokens=False) == [97, 98]
    assert completion_prompt_ids(tok, [5, 6]) == [5, 6]  # token ids are taken as given


def test_tokenize_and_detokenize_bodies_in_vllms_shape():
    tok = RecordingTokenizer()
    assert tokenize_body(tok, TokenizeCompletionRequest(prompt="ab", return_token_strs=True), 8192) == {
        "count": 3, "max_model_len": 8192, "tokens": [1, 97, 98], "token_strs": ["\x01", "a", "b"]}
    chat = tokenize_body(tok, TokenizeChatRequest(messages=MESSAGES), 8192)
    assert tok.decode(chat["tokens"]) == "user:hi|assistant:he|>" and chat["token_strs"] is None
    assert detokenize_body(tok, DetokenizeRequest(tokens=[104, 105])) == {"prompt": "hi"}
    with pytest.raises(APIError) as info:
        detokenize_body(tok, DetokenizeRequest(tokens=[1000]))
    assert info.value.status == 400
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=[-1])
    # As vLLM's server: a field it does not know is ignored, not a 400.
    assert TokenizeCompletionRequest(prompt="x", surprise=1).prompt == "x"


@pytest.mark.parametrize("data,param", [
    ({}, "prompt"), ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ({"messages": []}, "messages"), ({"prompt": 3}, "prompt"), ([1], None),
    ({"messages": MESSAGES, "continue_final_message": True}, None),
])
def test_a_tokenize_body_is_chat_when_it_has_messages_and_its_errors_name_the_field(data, param):
    with pytest.raises(APIError) as info:
        tokenize_request(data)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert "function-after" not in info.value.message and "Tokenize" not in info.value.message
    assert isinstance(tokenize_request({"messages": MESSAGES}), TokenizeChatRequest)
    assert isinstance(tokenize_request({"prompt": "x"}), TokenizeCompletionRequest)


def test_a_debug_prefix_body_takes_token_ids_text_or_messages():
    tok = RecordingTokenizer()
    assert prefix_request_ids(tok, {"prompt": [5, 0, 7]}) == [5, 0, 7]  # as given: no special token
    assert prefix_request_ids(tok, {"prompt": "ab"}) == [1, 97, 98]  # completions' default
    assert prefix_request_ids(tok, {"messages": MESSAGES[:1]}) == [ord(c) for c in "user:hi|>"]
    for bad in ([1, -2], [1, 2.0], [True], ["a"]):
        with pytest.raises(APIError) as info:
            prefix_request_ids(tok, {"prompt": bad})
        assert info.value.status == 400 and info.value.param == "prompt"
    with pytest.raises(APIError):
        prefix_request_ids(tok, ["not", "an", "object"])
