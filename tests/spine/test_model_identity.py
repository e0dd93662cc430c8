"""The weights' identity in the KVCache pool's layout string (kv_connector/model_identity.py): a
fine-tune of the same architecture never reads the base model's blocks (found by an audit: the
layout named only shapes and dtype, and a restart with another checkpoint on the same SSD
directory loaded the other model's KV with valid checksums)."""

import json
import shutil

import numpy as np
import torch

from kv_connector.model_identity import SAMPLE_BYTES, model_identity, weights_fingerprint
from kv_connector.pool_copier import ArenaLayout
from store.ssd import SsdTier


def checkpoint(folder, seed: int, size: int = 3 * SAMPLE_BYTES + 123):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "model.safetensors").write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return folder


def test_the_same_weights_anywhere_are_one_model_and_a_fine_tune_is_another(tmp_path):
    base = checkpoint(tmp_path / "base", seed=1)
    copy = tmp_path / "elsewhere" / "base"
    shutil.copytree(base, copy)
    tuned = checkpoint(tmp_path / "tuned", seed=2)  # same names and sizes, other bytes
    assert model_identity(str(base)) == model_identity(str(copy))  # another node's path: still shared
    assert model_identity(str(base)) != model_identity(str(tuned))
    data = bytearray((base / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte in the middle of the weights
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert weights_fingerprint(str(copy)) != weights_fingerprint(str(base))
    assert model_identity(str(base), quantization="fp8") != model_identity(str(base))


def test_a_hub_name_is_named_by_its_revision_and_commit(tmp_path):
    assert model_identity("org/model", "main", commit="abc") != model_identity("org/model", "main", commit="def")
    assert json.loads(model_identity("org/model", "v2"))["revision"] == "v2"
    assert weights_fingerprint(str(tmp_path)) is None  # a folder without weights: named by its path


def test_two_models_of_one_shape_get_different_layouts_and_ssd_directories(tmp_path):
    caches = {f"layer.{i}": torch.zeros(8, 2, 16, 4, 8) for i in range(2)}
    layout = ArenaLayout.of(caches)
    a = layout.describe(caches, 16, model_identity(str(checkpoint(tmp_path / "a", seed=1))))
    b = layout.describe(caches, 16, model_identity(str(checkpoint(tmp_path / "b", seed=2))))
    assert a != b
    assert SsdTier(str(tmp_path / "ssd"), a, layout.block_bytes).root != SsdTier(str(tmp_path / "ssd"), b,
                                                                                  layout.block_bytes).root
