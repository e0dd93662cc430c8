"""Turning a stream of token ids into a stream of text, with OpenAI stop strings.

Pure: a tokenizer in, strings out. The conductor detokenizes (not the workers) because the
first token comes from the prefill worker and the rest from the decode worker: only one place
sees the whole sequence, and a stop string may straddle the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Emits text as tokens arrive, holding back bytes of a character split across tokens.

    Decodes a short window (from `prefix_offset`) rather than the whole output each time, so
    cost per token stays constant; the window keeps enough left context for tokenizers whose
    output depends on the previous token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is still held back, less an incomplete character at the very end: the bytes of a
        character cut by max_tokens decode to U+FFFD, which vLLM's detokenizer never emits."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):].rstrip("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""


@dataclass
class StopResult:
    text: str  # safe to send now
    stopped: bool  # a stop string matched; nothing more will be emitted
    stop: str | None = None  # the stop string that matched (on the push that matched)


class StopStringMatcher:
    """Withholds the tail that could still become a stop string, and cuts text at a match.

    The stop string itself is not included in the output (OpenAI semantics). Where several stop
    strings match, the one that completes first wins (ties: the first listed), as if the text
    came one character at a time, as vLLM's detokenizer decides. Text pushed as `protected` (the
    first min_tokens tokens' text) cannot complete a match, as in vLLM: a stop string must end
    after it.
    """

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self._protected = 0  # how many leading characters of _pending no match may end within
        self._stopped = False

    @property
    def watching(self) -> bool:
        """Some stop string may still end the text."""
        return bool(self._stops) and not self._stopped

    def push(self, text: str, protected: bool = False) -> StopResult:
        if self._stopped:
            return StopResult("", True)
        self._pending += text
        if protected and text:  # protected text comes first, so all before it is protected too
            self._protected = len(self._pending)
        cut, stop = (-1, None) if protected else self._first_match()
        if cut >= 0:
            self._stopped = True
            out, self._pending = self._pending[:cut], ""
            return StopResult(out, True, stop)
        if not self._stops:
            out, self._pending = self._pending, ""
            return StopResult(out, False)
        keep = min(self._hold, len(self._pending))
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(self._pending) - keep:]
        self._protected = max(0, self._protected - len(out))
        return StopResult(out, False)

    def _first_match(self) -> tuple[int, str | None]:
        """Where the stop string that completes first starts in _pending, and which it is
        ((-1, None): none)."""
        best_end, best_start, best = None, -1, None
        for stop in self._stops:
            start = self._pending.find(stop, max(0, self._protected - len(stop) + 1))
            if start >= 0 and (best_end is None or start + len(stop) < best_end):
                best_end, best_start, best = start + len(stop), start, stop
        return best_start, best

    def flush(self) -> str:
        out, self._pending = ("" if self._stopped else self._pending), ""
        return out
