"""The Mooncake trace format, read strictly: shared by the simulator and `mooncake bench`.

Format: one JSON object per line: timestamp (ms), input_length, output_length, hash_ids
(one id per block of the trace's block size, 512 tokens in the released trace; equal ids =
equal prefix blocks). A malformed line raises TraceError naming the file and line; nothing is
skipped silently (blank lines excepted).
"""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass


class TraceError(ValueError):
    def __init__(self, path: str, line: int, message: str) -> None:
        # line 0: the file as a whole (an empty trace), not one of its lines
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")
        self.path, self.line = path, line


@dataclass(frozen=True, slots=True)
class TraceRecord:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


MAX_TOKENS = 10_000_000
"""A length beyond any model's context: a larger one is a broken line, not a request."""
MAX_TIMESTAMP_MS = 1e15
"""About 30,000 years in ms: epoch timestamps fit; larger is a broken line."""


def shown(value: object, limit: int = 40) -> str:
    """A value as a message quotes it: a broken line's 4000-digit number is cut, not printed whole."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _int_field(obj: dict, key: str, minimum: int, path: str, line: int) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(path, line, f"'{key}' must be an integer, got {shown(v)}")
    if not minimum <= v <= MAX_TOKENS:
        raise TraceError(path, line, f"'{key}' must be in [{minimum}, {MAX_TOKENS:,}], got {shown(v)}")
    return v


def json_object_line(text: str, line: int, path: str, error: type[TraceError] = TraceError) -> dict:
    """One line of a JSON-lines file that must hold an object; `error` names file and line."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(path, line, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except ValueError:  # Python refuses to convert an integer literal of more than 4300 digits
        raise error(path, line, f"holds a number of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise error(path, line, "JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise error(path, line, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_line(text: str, line: int, path: str = "<trace>") -> TraceRecord:
    obj = json_object_line(text, line, path)
    ts = obj.get("timestamp")
    # Compared as it is, not through float(): an integer past 1e308 does not fit one. The range
    # excludes nan and inf too (every comparison with nan is false).
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        raise TraceError(path, line,
                         f"'timestamp' must be a number of ms in [0, {MAX_TIMESTAMP_MS:g}], got {shown(ts)}")
    ids = obj.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(path, line, "'hash_ids' must be a list of integers")
    return TraceRecord(line, float(ts), _int_field(obj, "input_length", 1, path, line),
                       _int_field(obj, "output_length", 0, path, line), tuple(ids))


def load_trace(path: str | pathlib.Path, limit: int | None = None) -> list[TraceRecord]:
    """All records, or the first `limit` of the file, sorted by timestamp (stable). Raises
    TraceError on the first bad line read.

    With a limit the file is read no further than its limit-th record: a replay of the first
    thousand requests of a trace of millions neither waits for nor is stopped by the rest. The
    records are the file's first ones, which are its earliest when the file is in time order (the
    released traces are)."""
    if limit is not None and limit <= 0:
        raise ValueError(f"a trace limit must be positive, got {limit}")
    records: list[TraceRecord] = []
    with open(path, "rb") as f:  # bytes, so an undecodable line is reported by its number too
        for n, raw in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # tolerate a byte-order mark
            except UnicodeDecodeError:
                raise TraceError(str(path), n, "not UTF-8 text") from None
            if text.strip():
                records.append(parse_line(text, n, str(path)))
    if not records:
        raise TraceError(str(path), 0, "trace has no records")
    records.sort(key=lambda r: r.timestamp_ms)
    return records


def block_count_mismatches(records: list[TraceRecord], block_size: int) -> list[TraceRecord]:
    """Records whose hash_ids do not number ceil(input_length / block_size): a sign that the
    trace was written with another block size (hash_ids then name the wrong token spans)."""
    return [r for r in records if r.hash_ids and len(r.hash_ids) != -(-r.input_length // block_size)]


def fitting_block_sizes(records: list[TraceRecord], candidates=(16, 32, 64, 128, 256, 512, 1024, 2048)) -> list[int]:
    """The candidate block sizes that every record's hash_ids count agrees with."""
    return [b for b in candidates if not block_count_mismatches(records, b)]


def block_size_warning(records: list[TraceRecord], block_size: int, flag: str) -> str | None:
    """A warning for the records whose hash_ids do not fit `block_size` (None when all do), with
    the block size that would fit every line, as the command's `flag`."""
    bad = block_count_mismatches(records, block_size)
    if not bad:
        return None
    fits = fitting_block_sizes(records)
    hint = f"; {flag} {fits[0]} fits every line" if fits else ""
    first = min(r.line for r in bad)
    return (f"warning: {len(bad)} of {len(records)} lines (first: line {first}) do not have "
            f"ceil(input_length / {block_size}) hash_ids{hint}")
