import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.hashing import ROOT_PARENT, encode_extra_keys, hash_block_tokens, hash_prompt_blocks

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=200)
BS = 4


def chain(tok, bs, extra=()):
    parent, out = None, []
    for i in range(len(tok) // bs):
        parent = hash_block_tokens(parent, tok[i * bs:(i + 1) * bs], extra)
        out.append(parent)
    return out


@given(tokens, st.sampled_from([1, 3, 4, 16]))
def test_prompt_hash_equals_block_chain(tok, bs):
    assert hash_prompt_blocks(tok, bs, ("m", 7)) == chain(tok, bs, ("m", 7))
    assert hash_prompt_blocks(np.array(tok, dtype=np.uint64), bs, ("m", 7)) == chain(tok, bs, ("m", 7))


@given(tokens, tokens, tokens)
def test_equal_prefixes_give_equal_keys(prefix, a, b):
    ka, kb = hash_prompt_blocks(prefix + a, BS), hash_prompt_blocks(prefix + b, BS)
    n = len(prefix) // BS
    assert ka[:n] == kb[:n]


@settings(max_examples=200)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=BS, max_size=80), st.data())
def test_any_change_changes_that_block_and_every_later_key(tok, data):
    i = data.draw(st.integers(0, len(tok) // BS * BS - 1))
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tok[i]))
    changed = tok[:i] + [new] + tok[i + 1:]
    k1, k2 = hash_prompt_blocks(tok, BS), hash_prompt_blocks(changed, BS)
    b = i // BS
    assert k1[:b] == k2[:b]
    assert all(x != y for x, y in zip(k1[b:], k2[b:], strict=True))


@given(tokens)
def test_extra_keys_separate_namespaces(tok):
    if len(tok) >= BS:
        assert hash_prompt_blocks(tok, BS, ("model-a",))[0] != hash_prompt_blocks(tok, BS, ("model-b",))[0]


def test_only_full_blocks_and_fixed_values():
    assert hash_prompt_blocks([1, 2, 3], 4) == []
    assert len(hash_prompt_blocks(list(range(9)), 4)) == 2
    # Pinned value: a change here breaks every cache across processes and releases.
    assert hash_prompt_blocks([1, 2, 3, 4], 4, ("m",))[0] == hash_block_tokens(None, [1, 2, 3, 4], ("m",))
    assert hash_prompt_blocks([1, 2, 3, 4], 4, ("m",))[0] == 0xD4BEE2883EB804B29A3A50A7034993AC
    assert ROOT_PARENT == 0x381D93A486C8557675795862E108C40E  # a fixed constant, never per-process


def test_extra_key_encoding_is_unambiguous():
    assert encode_extra_keys(("ab", "c")) != encode_extra_keys(("a", "bc"))
    assert encode_extra_keys((1,)) != encode_extra_keys(("1",))
    with pytest.raises(TypeError):
        encode_extra_keys((True,))
    with pytest.raises(TypeError):
        encode_extra_keys((1.5,))  # type: ignore[arg-type]


def test_bad_tokens_and_block_size():
    with pytest.raises(ValueError):
        hash_prompt_blocks([-1, 2], 1)
    with pytest.raises(ValueError):
        hash_prompt_blocks([2**32], 1)
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2], 0)


def test_128k_tokens_hash_fast():
    tok = np.random.default_rng(0).integers(0, 100_000, 131_072)
    best = min(_time(lambda: hash_prompt_blocks(tok, 16)) for _ in range(5))
    # About 3 ms on the dev box; the figure itself belongs to a benchmark. This bound only
    # catches a fall back to per-token Python work (hundreds of ms), with room for a loaded CI.
    assert best < 0.050


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
