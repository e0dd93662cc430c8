"""What `mooncake bench` sends and when: prompts and arrival schedules. Pure: data in, data out.

A workload is a list of RequestSpec (what a request is: lengths, shared blocks, trace time);
token ids are drawn from it per run with a salt, so every rate of a sweep sends the same shapes
(lengths, prefix sharing, arrivals) with fresh ids: no rate is served from the prefix cache an
earlier rate warmed, which would flatter every rate but the first. (A --prompts-file's prompts
are the exception: they are sent as written, at every rate.)
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import numpy as np

from mooncake.trace import MAX_TOKENS, TraceError, TraceRecord, json_object_line, shown

LOW_TOKEN_ID = 1000
"""Token ids are drawn from [LOW_TOKEN_ID, vocab_size): the low end holds special tokens."""


class PromptsFileError(TraceError):
    """A malformed line of a --prompts-file (same file:line message as a trace's)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    """Position in the workload (0-based); seeds the request's private tokens."""
    input_length: int
    """Prompt tokens (after --max-input-len), or 0 for a text prompt."""
    max_tokens: int
    """Output tokens asked for."""
    hash_ids: tuple[int, ...] = ()
    """Trace blocks: equal ids give equal token blocks."""
    shared_prefix: int = 0
    """Leading tokens common to every generated prompt (0: none)."""
    timestamp_ms: float = 0.0
    """Arrival time in the trace (for --arrival trace)."""
    text: str | list[int] | None = None
    """A prompt given verbatim (--prompts-file); sent as is in every run."""


def _tokens(seed: tuple[int, ...], n: int, vocab_size: int) -> list[int]:
    return np.random.default_rng(seed).integers(LOW_TOKEN_ID, vocab_size, size=n).tolist()


def prompt_of(spec: RequestSpec, *, block_size: int, vocab_size: int, seed: int, salt: int) -> str | list[int]:
    """The prompt of one request in the run salted `salt`.

    Trace requests: block i is a function of (seed, salt, hash_ids[i]) alone, so two requests
    naming the same hash id carry the same block_size tokens there; the concatenation is cut to
    input_length (and tokens beyond the named blocks are private to the request)."""
    if spec.text is not None:
        return spec.text
    out: list[int] = []
    if spec.shared_prefix:
        out = _tokens((seed, salt, 1, 0), spec.shared_prefix, vocab_size)
    for h in spec.hash_ids:
        if len(out) >= spec.input_length:
            break
        # hash ids may be any integer; the seed sequence wants non-negative ones (mapped one to one,
        # so two ids never name the same tokens: that would fake prefix sharing)
        out += _tokens((seed, salt, 2, 2 * h if h >= 0 else -2 * h - 1), block_size, vocab_size)
    if len(out) < spec.input_length:
        out += _tokens((seed, salt, 3, spec.index), spec.input_length - len(out), vocab_size)
    return out[:spec.input_length]


def trace_specs(records: list[TraceRecord], *, max_input_len: int | None = None,
                max_output_len: int | None = None) -> list[RequestSpec]:
    """One spec per trace record; prompts truncated to max_input_len, outputs capped and at
    least 1 token (an OpenAI server refuses max_tokens=0)."""
    specs = []
    for i, r in enumerate(records):
        n_in = min(r.input_length, max_input_len) if max_input_len else r.input_length
        n_out = max(1, min(r.output_length, max_output_len) if max_output_len else r.output_length)
        specs.append(RequestSpec(i, n_in, n_out, r.hash_ids, 0, r.timestamp_ms))
    return specs


def generated_specs(n: int, input_len: tuple[int, int], output_len: int, seed: int,
                    shared_prefix: int = 0) -> list[RequestSpec]:
    """n requests with input lengths uniform in [min, max] (seeded), independent random tokens
    after an optional common prefix of `shared_prefix` tokens."""
    lo, hi = input_len
    lengths = np.random.default_rng((seed, 0)).integers(lo, hi + 1, size=n)
    return [RequestSpec(i, int(length), output_len, (), min(shared_prefix, int(length)))
            for i, length in enumerate(lengths)]


def load_prompts_file(path: str | pathlib.Path, *, max_input_len: int | None = None,
                      max_output_len: int | None = None) -> list[RequestSpec]:
    """JSONL of {"prompt": str | [int], "max_tokens": int}; a bad line raises PromptsFileError.
    Token-id prompts are cut to max_input_len (a text prompt's tokens are the server's to count)
    and every max_tokens to max_output_len."""
    specs: list[RequestSpec] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                raise PromptsFileError(str(path), n, "not UTF-8 text") from None
            if text.strip():
                specs.append(_prompt_line(text, n, str(path), len(specs)))
    if not specs:
        raise PromptsFileError(str(path), 0, "prompts file has no lines")
    capped = []
    for spec in specs:
        ids = spec.text if isinstance(spec.text, list) else None
        if ids is not None and max_input_len and len(ids) > max_input_len:
            spec = RequestSpec(spec.index, max_input_len, spec.max_tokens, text=ids[:max_input_len])
        if max_output_len and spec.max_tokens > max_output_len:
            spec = RequestSpec(spec.index, spec.input_length, max_output_len, text=spec.text)
        capped.append(spec)
    return capped


def _prompt_line(text: str, line: int, path: str, index: int) -> RequestSpec:
    obj = json_object_line(text, line, path, PromptsFileError)
    prompt = obj.get("prompt")
    is_ids = isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise PromptsFileError(path, line, "'prompt' must be a non-empty string or list of token ids")
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate escaped in the JSON ("\\ud800")
            raise PromptsFileError(path, line, f"'prompt' cannot be sent as UTF-8: {exc.reason} at "
                                               f"character {exc.start}") from None
    mt = obj.get("max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_TOKENS:
        raise PromptsFileError(path, line, f"'max_tokens' must be an integer in [1, {MAX_TOKENS:,}], got {shown(mt)}")
    return RequestSpec(index, len(prompt) if is_ids else 0, mt, text=prompt)


# -- arrivals ---------------------------------------------------------------------------------

def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the run's start, first at 0) of a Poisson process at `rate` req/s.

    The unit-rate gaps depend on the seed only and are divided by the rate, so every rate of a
    sweep sees the same pattern of bursts, stretched: rates differ in load, not in luck."""
    if n <= 0:
        return []
    gaps = np.random.default_rng((seed, 1)).exponential(1.0, size=n)
    gaps[0] = 0.0
    return (np.cumsum(gaps) / rate).tolist()


def trace_offsets(specs: list[RequestSpec], time_scale: float) -> list[float]:
    """Send times from the trace's own timestamps, the first at 0, multiplied by time_scale
    (0.5 replays twice as fast)."""
    if not specs:
        return []
    t0 = min(s.timestamp_ms for s in specs)
    return [(s.timestamp_ms - t0) / 1000.0 * time_scale for s in specs]


def offered_rate(offsets: list[float]) -> float:
    """Requests per second the schedule offers: (n - 1) arrivals over its span."""
    span = max(offsets) - min(offsets) if offsets else 0.0
    return (len(offsets) - 1) / span if span > 0 else math.inf
