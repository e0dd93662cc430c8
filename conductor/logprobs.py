"""OpenAI logprobs bodies from the workers' per-position entries (mooncake/protocol.py
PositionLogprobs), shaped exactly as vLLM's OpenAI server shapes them, so that a client sees the
same fields whether it talks to one vLLM engine or to this cluster.

Each position's entries are in vLLM's order: the chosen token first, then the top-k by rank.
Completions list the first k+1 entries (OpenAI's "top logprobs + the chosen one"), keyed by
token text; chat lists the first k.
"""

from __future__ import annotations

import json
from typing import Protocol

from mooncake.protocol import PositionLogprobs


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


class TokenText:
    """The text of one token alone, as vLLM writes it in logprobs (convert_ids_list_to_tokens):
    decode() of the single id, with the leading spaces a SentencePiece-style tokenizer's decode()
    strips put back."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._marker = _leading_space_marker(tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id]) or ""
            if self._marker is not None:
                raw = self._tok.convert_ids_to_tokens([token_id])[0] or ""
                markers = len(raw) - len(raw.lstrip(self._marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                text = " " * missing + text if missing > 0 else text
            self._cache[token_id] = text
        return text


def _leading_space_marker(tokenizer) -> str | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except Exception:  # noqa: BLE001 - a tokenizer without a readable config: no marker
        return None
    for sub in [pre, *pre.get("pretokenizers", [])]:
        if sub.get("type") == "Metaspace":
            return sub.get("replacement", "\u2581")
    return None


class CompletionLogprobs:
    """The `logprobs` object of /v1/completions choices; keeps the running text offset so that a
    stream's pieces continue one another."""

    def __init__(self, top: int, text: TokenText):
        self._top, self._text = top, text
        self._offset = 0  # where the next token starts, counted in token texts as vLLM does

    def body(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> dict:
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for token_id, entries in zip(token_ids, positions):
            token = self._text(token_id)
            out["text_offset"].append(self._offset)
            out["tokens"].append(token)
            if entries is None:  # the prompt's first token has no logprob
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                chosen = next((lp for t, lp, _ in entries if t == token_id), None)
                out["token_logprobs"].append(chosen)
                out["top_logprobs"].append({self._text(t): lp for t, lp, _ in entries[:self._top + 1]})
            self._offset += len(token)
        return out


def chat_content(token_ids: list[int], positions: list[PositionLogprobs], top: int, text: TokenText) -> list[dict]:
    """The `logprobs.content` list of /v1/chat/completions choices."""
    content = []
    for token_id, entries in zip(token_ids, positions):
        token = text(token_id)
        chosen = next((lp for t, lp, _ in entries if t == token_id), None)
        content.append({
            "token": token, "logprob": chosen, "bytes": list(token.encode("utf-8", errors="replace")),
            "top_logprobs": [{"token": (tt := text(t)), "logprob": lp, "bytes": list(tt.encode("utf-8", errors="replace"))}
                             for t, lp, _ in entries[:top]],
        })
    return content


def prompt_logprobs_body(positions: list[PositionLogprobs | None], text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
    {token id: {"logprob", "rank", "decoded_token"}}."""
    return [None if entries is None else
            {str(t): {"logprob": lp, "rank": rank, "decoded_token": text(t)} for t, lp, rank in entries}
            for entries in positions]
