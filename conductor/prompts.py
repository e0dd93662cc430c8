"""What the model reads: a request's prompt as token ids, and vLLM's /tokenize and /detokenize.

A completions prompt is the tokenizer's encoding of its text (with the tokenizer's special
tokens unless add_special_tokens is false) or the token ids given. Chat messages go through the
model's own chat template, rendered to text and then encoded, as vLLM does, with vLLM's options:
add_generation_prompt (default true), continue_final_message (the last assistant message left
open, for the model to continue), add_special_tokens (default false: the template writes its
own) and chat_template_kwargs (the template's variables). A template sent with the request is
refused: it would be code the server runs (vLLM refuses it too unless told to trust requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from conductor.errors import APIError, invalid_value
from conductor.schemas import UNTRUSTED_TEMPLATE, lone_surrogate_at, ChatMessage, ChatTemplateFields, DetokenizeRequest, \
    TokenizeChatRequest, TokenizeCompletionRequest

# apply_chat_template's own arguments, which the template's variables must not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_assistant_tokens_mask", "padding", "truncation",
    "max_length", "return_tensors", "tokenizer_kwargs"})


def completion_prompt_ids(tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
    return list(prompt)


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage], tools: list[Any] | None,
                    options: ChatTemplateFields) -> list[int]:
    """The prompt a chat request runs; APIError 400 for messages or options the template refuses."""
    if options.chat_template is not None:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template", code="unsupported_option")
    variables = options.chat_template_kwargs or {}
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(variables))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)} (a request field or the "
                            f"server's own)", param="chat_template_kwargs")
    try:
        rendered = [m.for_template() for m in messages]
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    try:
        text = tokenizer.apply_chat_template(
            rendered, tools=tools or None, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, tokenize=False, **variables)
    except Exception as exc:  # noqa: BLE001 - the template ran on the request's messages and variables
        # (a TemplateError, ValueError, TypeError, or whatever a variable of the wrong type raises)
        raise APIError(400, f"the model's chat template cannot render these messages: "
                            f"{type(exc).__name__}: {exc}", param="messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=options.add_special_tokens))


def tokenize_request(data: Any) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """POST /tokenize's body: chat messages when it has `messages`, else a prompt. Parsed here,
    not by a union in the route's signature, so an error names the body's own field."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object with a prompt or messages", code="invalid_value")
    if "messages" in data and "prompt" in data:  # unknown fields are ignored, but not this ambiguity
        raise APIError(400, "give either prompt or messages, not both", param="prompt", code="invalid_value")
    where = lone_surrogate_at(data)  # the tokenizer would fail on it (a 500), as completions check too
    if where is not None:
        raise APIError(400, f"{where or 'the body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is "
                            f"not valid Unicode text", param=where or None, code="invalid_value")
    model = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise invalid_value([str(p) for p in first.get("loc", ())], first) from None


def request_prompt_ids(tokenizer, body: TokenizeChatRequest | TokenizeCompletionRequest) -> list[int]:
    """The token ids a /tokenize-shaped body's prompt or chat messages become."""
    if isinstance(body, TokenizeChatRequest):
        return chat_prompt_ids(tokenizer, body.messages, body.tools, body)
    return completion_prompt_ids(tokenizer, body.prompt, body.add_special_tokens)


def prefix_request_ids(tokenizer, data: Any) -> list[int]:
    """/internal/debug/prefix's body: /tokenize's, or a prompt of token ids (as completions take)."""
    if isinstance(data, dict) and isinstance(data.get("prompt"), list):
        ids = data["prompt"]
        if not all(type(t) is int and t >= 0 for t in ids):
            raise APIError(400, "prompt: token ids must be non-negative integers", param="prompt",
                           code="invalid_value")
        return ids
    return request_prompt_ids(tokenizer, tokenize_request(data))


def tokenize_body(tokenizer, body: TokenizeChatRequest | TokenizeCompletionRequest, max_model_len: int) -> dict:
    """POST /tokenize's answer, in vLLM's shape."""
    ids = request_prompt_ids(tokenizer, body)
    strs = list(tokenizer.convert_ids_to_tokens(ids)) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(tokenizer, body: DetokenizeRequest) -> dict:
    """POST /detokenize's answer, in vLLM's shape."""
    vocab = len(tokenizer)
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens", code="invalid_value")
    return {"prompt": tokenizer.decode(body.tokens)}
