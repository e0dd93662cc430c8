"""Which weights a block of KV was computed with, for the KVCache pool's layout string.

The pool keys blocks by their tokens' chained hash, and keeps them across restarts (the SSD tier)
and serves them to other nodes. The layout string it records with them (block size, layer names,
shapes, dtype) is the same for a base model and its fine-tune, or two revisions of one
checkpoint: without the weights' identity in it, such a model read the other's KV, with valid
checksums. A local folder (the usual case: vLLM is given a path) is named by a fingerprint of its
weight files' contents, so two nodes holding the same weights at different paths still share
blocks and a retrained checkpoint at the same path does not; a hub name by its resolved commit.
"""

from __future__ import annotations

import json
import os

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 64 << 10
"""Bytes hashed at the start, middle and end of each weight file: a few hundred KiB read per
engine start, and a fine-tune changes every tensor, so any sample differs."""


def weights_fingerprint(folder: str) -> str | None:
    """xxh3-64 over each weight file's name, size and three samples of its bytes; None when the
    folder holds no weight file."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(WEIGHT_SUFFIXES)
                   and os.path.isfile(os.path.join(folder, n)))
    if not names:
        return None
    digest = xxhash.xxh3_64()
    for name in names:
        path = os.path.join(folder, name)
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for offset in sorted({0, max(size // 2 - SAMPLE_BYTES // 2, 0), max(size - SAMPLE_BYTES, 0)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def model_identity(model: str, revision: str | None = None, quantization: str | None = None,
                   commit: str | None = None) -> str:
    """A stable text naming the weights: vLLM's model (a path or a hub name), its revision and
    quantization, and the hub commit it resolved to (the config's _commit_hash), if any."""
    parts: dict[str, str | None] = {"quantization": quantization}
    fingerprint = weights_fingerprint(model) if os.path.isdir(model) else None
    if fingerprint is not None:
        parts["weights"] = fingerprint  # not the path: the same weights elsewhere are the same model
    else:
        parts.update(model=model, revision=revision, commit=commit)
    return json.dumps(parts, sort_keys=True)


def model_identity_of(model_config) -> str:
    """model_identity of a vLLM ModelConfig."""
    hf_config = getattr(model_config, "hf_config", None)
    return model_identity(str(model_config.model), getattr(model_config, "revision", None),
                          getattr(model_config, "quantization", None), getattr(hf_config, "_commit_hash", None))
