"""Prefix-block hashing: the one function every process uses to name KV blocks.

key(block i) = xxh3_128(key(block i-1) || tokens of block i || extra keys)

The chain makes a block's key name its whole prefix, so two prompts share a key exactly
where they share every token up to the end of that block. The byte encoding is canonical
(tokens as little-endian uint32, the parent as its 16-byte big-endian digest, which is
xxh3's canonical form, extra keys tagged and length-prefixed) and xxh3 is seedless here, so
a key is the same in every process, on every run and on every host. Python's ``hash()`` is salted per process and must never be used:
a silent 0 % cache hit rate across processes is the classic symptom.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import NewType

import numpy as np
import xxhash

BlockHash = NewType("BlockHash", int)
"""A 128-bit prefix-block key (an unsigned int below 2**128)."""

ExtraKey = str | int | bytes

# The parent of the first block: a fixed, documented constant rather than a per-process
# random value, so that first-block keys agree everywhere.
ROOT_PARENT: BlockHash = BlockHash(xxhash.xxh3_128_intdigest(b"mooncake/prefix-root/v1"))

_UINT32_MAX = 2**32 - 1


def encode_extra_keys(extra_keys: Sequence[ExtraKey]) -> bytes:
    """Canonical bytes for extra keys (model name, cache salt, LoRA id, ...).

    Each key is tagged by type and length-prefixed, so ("ab", "c") and ("a", "bc") differ
    and the int 1 differs from the string "1".
    """
    parts: list[bytes] = []
    for key in extra_keys:
        if isinstance(key, bool):  # bool is an int subclass; refuse the ambiguity
            raise TypeError("extra key must be str, int or bytes, not bool")
        if isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        elif isinstance(key, int):
            tag, raw = b"i", str(key).encode("ascii")
        elif isinstance(key, bytes):
            tag, raw = b"b", key
        else:
            raise TypeError(f"extra key must be str, int or bytes, got {type(key).__name__}")
        parts.append(tag + len(raw).to_bytes(4, "little") + raw)
    return b"".join(parts)


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    if isinstance(token_ids, list):
        # array('I') converts a Python list about 3x faster than np.asarray and range-checks.
        try:
            arr32 = array.array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError("token ids must be integers in [0, 2**32)") from exc
        if sys.byteorder != "little":
            arr32.byteswap()
        return arr32.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > _UINT32_MAX):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Key of one block given its parent's key (None for the first block)."""
    parent_bytes = (ROOT_PARENT if parent is None else parent).to_bytes(16, "big")
    payload = parent_bytes + _token_bytes(token_ids) + encode_extra_keys(extra_keys)
    return BlockHash(xxhash.xxh3_128_intdigest(payload))


def hash_prompt_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
) -> list[BlockHash]:
    """Keys of every FULL block of the prompt, in order; a trailing partial block gets none.

    Equal to chaining ``hash_block_tokens`` block by block, but encodes all tokens in one
    numpy call and slices the buffer, so 128k tokens hash in about a millisecond.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = _token_bytes(token_ids)
    extra = encode_extra_keys(extra_keys)
    stride = 4 * block_size
    n_blocks = len(data) // stride
    view = memoryview(data)
    digest = xxhash.xxh3_128_digest
    # Chain on the raw 16-byte digests and convert to ints once at the end: the int <-> bytes
    # round trip per block would double the cost of this loop.
    digests: list[bytes] = []
    parent = ROOT_PARENT.to_bytes(16, "big")
    for i in range(n_blocks):
        parent = digest(b"".join((parent, view[i * stride:(i + 1) * stride], extra)))
        digests.append(parent)
    from_bytes = int.from_bytes
    return [BlockHash(from_bytes(d, "big")) for d in digests]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens (the last one may be partial)."""
    return -(-num_tokens // block_size)
