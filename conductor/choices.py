"""One choice (one of the `n` samples) of an answer, built from the workers' chunks: its text,
cut at stop strings, and its logprobs in the endpoint's shape. Pure: chunks in, events out."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from conductor.logprobs import CompletionLogprobs, TokenText, chat_content
from conductor.textstream import IncrementalDetokenizer, StopStringMatcher
from mooncake.protocol import GenerateChunk, PositionLogprobs


@dataclass(frozen=True)
class LogprobsWanted:
    chat: bool
    top: int  # completions: logprobs=N; chat: top_logprobs
    text: TokenText


@dataclass(frozen=True)
class Echo:
    """The prompt a completion echoes before its own text (`echo`). `only`: max_tokens 0, the
    prompt (and its logprobs) alone, as vLLM answers it: the one token generated is dropped."""
    text: str
    token_ids: list[int]
    only: bool = False


@dataclass
class ChoiceEvent:
    index: int
    text: str
    finish: str | None  # set on the choice's last event
    logprobs: dict | None  # this piece's logprobs body (None when not asked)
    stop_reason: int | str | None = None  # with finish "stop": the stop string or token id (vLLM's)
    tokens: int = 0  # the choice's tokens generated so far (a stream's continuous usage is per choice)


@dataclass
class Choice:
    index: int
    tokenizer: object
    stops: list[str]
    wanted: LogprobsWanted | None = None
    echo: Echo | None = None
    min_tokens: int = 0  # no stop string may complete within the text of the first min_tokens tokens
    count: int = 0  # tokens generated
    done: bool = False
    text: str = ""  # everything emitted so far
    finish: str = "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)
    logprobs: dict | None = None  # everything emitted so far (the non-streamed answer's)
    _detok: IncrementalDetokenizer = field(init=False)
    _stopper: StopStringMatcher = field(init=False)
    _completion: CompletionLogprobs | None = field(init=False, default=None)
    _echoed: bool = field(init=False, default=False)

    def __post_init__(self):
        self._detok = IncrementalDetokenizer(self.tokenizer)
        self._stopper = StopStringMatcher(self.stops)
        if self.wanted is not None:
            if self.wanted.chat:
                self.logprobs = {"content": []}
            else:
                self._completion = CompletionLogprobs(self.wanted.top, self.wanted.text)
                self.logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}

    def push(self, chunk: GenerateChunk, prompt_positions: list[PositionLogprobs | None]) -> ChoiceEvent | None:
        """The event for this chunk (None when it adds nothing to send). `prompt_positions`: the
        prompt's logprobs as far as known (needed for an echo with logprobs)."""
        if self.done:
            return None
        if len(chunk.token_ids) > 1 and self._stopper.watching and not (self.echo is not None and self.echo.only):
            # A stop string may complete at any token of the chunk (vLLM's outputs merge several
            # steps' tokens when the reader lags): the tokens, usage and logprobs after it are not
            # the answer's, as vLLM, which checks after every step, never generates them.
            return self._push_each(chunk, prompt_positions)
        return self._push(chunk, prompt_positions)

    def _push_each(self, chunk: GenerateChunk, prompt_positions: list[PositionLogprobs | None]) -> ChoiceEvent | None:
        events, last = [], len(chunk.token_ids) - 1
        for i, token in enumerate(chunk.token_ids):
            one = msgspec.structs.replace(
                chunk, token_ids=[token], logprobs=None if chunk.logprobs is None else chunk.logprobs[i:i + 1],
                finish_reason=chunk.finish_reason if i == last else None,
                stop_reason=chunk.stop_reason if i == last else None)
            event = self._push(one, prompt_positions)
            if event is not None:
                events.append(event)
            if self.done:
                break
        if not events:
            return None
        piece = None
        for event in events:
            if event.logprobs is not None:
                if piece is None:
                    piece = {key: [] for key in event.logprobs}
                for key, values in event.logprobs.items():
                    piece[key].extend(values)
        end = events[-1]
        return ChoiceEvent(self.index, "".join(e.text for e in events), end.finish, piece, end.stop_reason,
                           self.count)

    def _push(self, chunk: GenerateChunk, prompt_positions: list[PositionLogprobs | None]) -> ChoiceEvent | None:
        if self.echo is not None and self.echo.only:
            first, self._echoed = not self._echoed, True
            positions = list(prompt_positions or [None] * len(self.echo.token_ids)) if first else []
            return self._event(self.echo.text if first else "", "length" if chunk.finish_reason else None,
                               self.echo.token_ids if first else [], positions)
        before = self.count
        self.count += len(chunk.token_ids)
        # A stop token (stop_token_ids) ends the answer without its text, as in vLLM (it counts
        # as generated, and keeps its logprobs).
        text_ids = list(chunk.token_ids)
        if chunk.finish_reason == "stop" and chunk.stop_reason is not None and text_ids:
            text_ids.pop()
        prefix, ids, positions = "", list(chunk.token_ids), list(chunk.logprobs or ())
        if self.echo is not None and not self._echoed:
            self._echoed = True
            prefix = self.echo.text
            ids = self.echo.token_ids + ids
            positions = list(prompt_positions or [None] * len(self.echo.token_ids)) + positions
        protected = max(0, min(len(text_ids), self.min_tokens - before))
        text = self._stopper.push(self._detok.push(text_ids[:protected]), protected=True).text if protected else ""
        result = self._stopper.push(self._detok.push(text_ids[protected:]))
        text, finish = text + result.text, None
        if result.stopped:
            finish, self.stop_reason = "stop", result.stop
        elif chunk.finish_reason is not None:
            tail = self._stopper.push(self._detok.flush(), protected=self.count <= self.min_tokens)
            text += tail.text + ("" if tail.stopped else self._stopper.flush())
            finish = "stop" if tail.stopped else chunk.finish_reason
            self.stop_reason = tail.stop if tail.stopped else chunk.stop_reason
        return self._event(prefix + text, finish, ids, positions)

    def end(self) -> ChoiceEvent:
        """The workers' stream ended without a finish reason for this choice."""
        return self._event(self._stopper.flush(), "stop", [], [])

    def _event(self, text: str, finish: str | None, ids: list[int], positions: list) -> ChoiceEvent | None:
        if finish is not None:
            self.done, self.finish = True, finish
        self.text += text
        piece = None
        if self.wanted is not None and ids and positions:
            if self._completion is not None:
                piece = self._completion.body(ids, positions)
                for key, values in piece.items():
                    self.logprobs[key].extend(values)
            else:
                piece = {"content": chat_content(ids, positions, self.wanted.top, self.wanted.text)}
                self.logprobs["content"].extend(piece["content"])
        if not (text or finish or piece):
            return None
        return ChoiceEvent(self.index, text, finish, piece, self.stop_reason if finish else None, self.count)
