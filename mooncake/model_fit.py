"""Options checked against the model they will run, before any engine loads it (a minute on
CPU, after which vLLM refuses them anyway): a --max-model-len beyond the model's context, and on
vLLM-CPU a --kv-cache-gib too small for one sequence that long (vLLM's own two checks at start).

Read from the model folder's config.json. Only plain decoder configs are judged: a model whose
context is stretched (rope scaling), or whose KV is not one full-attention K and V per layer
(sliding windows, latent attention), is left to vLLM."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

from mooncake.defaults import Dtype

DTYPE_BYTES = {Dtype.FLOAT32: 4, Dtype.BFLOAT16: 2, Dtype.FLOAT16: 2}
_NOT_PLAIN_KV = ("sliding_window", "layer_types", "kv_lora_rank", "attention_chunk_size")


def cpu_engine() -> bool:
    """vLLM's CPU build is the installed engine (its KV cache is --kv-cache-gib of memory)."""
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def model_fit_errors(model_path: str, max_model_len: int, kv_cache_gib: float | None, dtype: str,
                     length_is: str = "--max-model-len") -> list[str]:
    """Why these options cannot run the model at model_path ([] when they can, or when its
    config.json cannot say). `length_is` names where max_model_len came from, for the message."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []  # not ours to judge: the engine says what is wrong with the folder
    if not isinstance(config, dict):
        return []
    text = config.get("text_config")
    config = text if isinstance(text, dict) else config
    errors = []
    # vLLM takes a longer length when told to, or up to the tokenizer's model_max_length.
    allowed = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").strip().lower() in ("1", "true")
    lengths = [v for v in (config.get("max_position_embeddings"), config.get("model_max_length")) if type(v) is int]
    longest = max(lengths) if lengths else None
    if longest is not None and not allowed and not _stretched(config) and max_model_len > longest:
        errors.append(f"{length_is} {max_model_len:,} is longer than the model's context ({longest:,} tokens, "
                      f"max_position_embeddings in {model_path}/config.json)")
    if kv_cache_gib is not None and not any(config.get(k) for k in _NOT_PLAIN_KV):
        per_token = kv_bytes_per_token(config, Dtype(dtype))
        need = per_token * max_model_len if per_token else 0
        if need > kv_cache_gib * 2**30:
            errors.append(f"--kv-cache-gib {kv_cache_gib:g} holds {int(kv_cache_gib * 2**30 // per_token):,} tokens of "
                          f"this model's KV in {dtype}, less than one sequence of {length_is} {max_model_len:,} "
                          f"({need / 2**30:.2f} GiB): give more, or ask for shorter sequences")
    return errors


def _stretched(config: dict) -> bool:
    """Rope scaling stretches the context past max_position_embeddings (a factor, at any depth:
    transformers v5 nests rope_parameters per layer type)."""
    def has_factor(value) -> bool:
        return isinstance(value, dict) and ("factor" in value or any(has_factor(v) for v in value.values()))
    return has_factor(config.get("rope_scaling")) or has_factor(config.get("rope_parameters"))


def kv_bytes_per_token(config: dict, dtype: Dtype) -> int | None:
    """K and V of every layer for one token, or None when config.json does not say."""
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size") // heads
                                          if type(config.get("hidden_size")) is int and type(heads) is int and heads
                                          else None)
    if not all(type(v) is int and v > 0 for v in (layers, kv_heads, head_dim)):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype]
