"""Where the blocks sit in one layer's paged KV cache, and a view with one block per row.

The scheduler's block ids index "manager" blocks. What the engine hands a connector varies:
- vLLM 0.32's backends (CPU and FlashAttention alike) put blocks first:
  [num_blocks, kv_heads, block_size, 2 * head_size];
- where the attention kernel's block is smaller than the scheduler's, dim 0 counts kernel
  blocks: num_blocks x ratio of them, a manager block being `ratio` adjacent rows;
- older vLLM's FlashAttention put K/V first: [2, num_blocks, block_size, kv_heads, head_size], so a
  block is two strided pieces, its K rows and its V rows.

Everything that moves blocks (the push to the decode worker, the pool's copies) works on a view
with one manager block per row of dim 0, and moves a block as that row (K-first: its K rows, then
its V rows). Two engines whose views agree in shape and dtype exchange blocks whatever their
layouts; the receiver checks exactly that before a byte moves.
"""

from __future__ import annotations

import torch


def blocks_first(cache: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
    """A view of `cache` (no copy) whose dim 0 indexes the scheduler's blocks. Without
    `num_blocks` (the engine did not say) dim 0 is taken as it is."""
    shape = tuple(cache.shape)
    if num_blocks is None or shape[0] == num_blocks:
        return cache
    if shape[0] > num_blocks and shape[0] % num_blocks == 0:  # kernel blocks, `ratio` per block
        return cache.unflatten(0, (num_blocks, -1))
    if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:  # K/V first
        return cache.transpose(0, 1)
    raise ValueError(f"a KV cache of shape {list(shape)} has neither {num_blocks} blocks (or a multiple) "
                     "at dim 0 nor at dim 1 behind a K/V dim of 2")


def runs(ids) -> list[tuple[int, int, int]]:
    """(position in ids, first id, count) per run of consecutive ids: one copy (or slice) each."""
    out: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == block:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, block, 1))
    return out


def block_bytes(view: torch.Tensor) -> int:
    """Bytes of one block of a blocks-first view."""
    return view[0].numel() * view.element_size()


def direct(view: torch.Tensor) -> bool:
    """Whether a blocks-first view's rows can be read and written in place as bytes: in host
    memory and contiguous. Otherwise rows are gathered into (or scattered from) a host buffer."""
    return view.device.type == "cpu" and view.is_contiguous()


def num_blocks_of(vllm_config, kv_cache_config) -> int | None:
    """How many blocks vLLM allocated per layer, from whichever of its configs says so."""
    for value in (getattr(kv_cache_config, "num_blocks", None),
                  getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", None)):
        if isinstance(value, int) and value > 0:
            return value
    return None
