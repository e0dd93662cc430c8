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


def full_response(meta: ResponseMeta, text: str, finish_reason: str, usage_body: dict) -> dict:
    if meta.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "choices": [choice], "usage": usage_body}


def chunk(meta: ResponseMeta, text: str | None, finish_reason: str | None = None,
          role: bool = False, usage_body: dict | None = None, no_choices: bool = False) -> str:
    if meta.chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model,
            "choices": [] if no_choices else [choice]}
    if usage_body is not None:
        body["usage"] = usage_body
    return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
