"""Building OpenAI response bodies and stream chunks (pure dict builders)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    chat: bool
    created: int

    @classmethod
    def new(cls, request_id: str, model: str, chat: bool) -> "ResponseMeta":
        return cls(id=("chatcmpl-" if chat else "cmpl-") + request_id, model=model, chat=chat,
                   created=int(time.time()))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(meta: ResponseMeta, index: int, text: str, finish_reason: str, logprobs: dict | None = None,
           prompt_logprobs: list | None = None, stop_reason: int | str | None = None) -> dict:
    """One choice of a whole (non-streamed) answer. `prompt_logprobs` (vLLM's extension) sits on
    each completion choice; on chat it is a field of the response (full_response). `stop_reason`
    (vLLM's too): the stop string or stop token id that ended the choice, None otherwise (EOS)."""
    if meta.chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}
    body = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def full_response(meta: ResponseMeta, choices: list[dict], usage_body: dict,
                  prompt_logprobs: list | None = None) -> dict:
    body = {"id": meta.id, "object": "chat.completion" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model, "choices": choices, "usage": usage_body}
    if meta.chat and prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def chunk(meta: ResponseMeta, text: str | None, finish_reason: str | None = None,
          role: bool = False, usage_body: dict | None = None, no_choices: bool = False,
          index: int = 0, logprobs: dict | None = None, stop_reason: int | str | None = None) -> str:
    if meta.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice_body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                       "stop_reason": stop_reason}
        obj = "chat.completion.chunk"
    else:
        choice_body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
                       "stop_reason": stop_reason}
        obj = "text_completion"
    body = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "choices": [] if no_choices else [choice_body]}
    if usage_body is not None:
        body["usage"] = usage_body
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
