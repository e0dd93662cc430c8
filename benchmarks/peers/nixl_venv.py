"""NIXL's own virtualenv, for side-by-side transfer measurements (benchmarks/transfer_bench.py).

`pip install nixl-cu12` drags in torch and CUDA (5.6 GB); with `--no-deps` it is 339 MB and
runs on CPU through its bundled UCX (ENVIRONMENT.md, "Peers"). It gets a venv of its own, so
the peer's UCX and numpy never meet our process: `.venvs/peer-nixl/`, built once with

- `python -m venv` from the running interpreter;
- `pip install --no-deps nixl-cu12==1.5.1 numpy`.

The module is `nixl_cu12`. `ucx_env()` gives the UCX settings every NIXL process here needs.

Run `python -m benchmarks.peers.nixl_venv` to build it and print where `nixl_cu12` resolves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.peers.venv import REPO_ROOT, peer_python

NIXL = "nixl-cu12==1.5.1"
EXTRA_PACKAGES = ["numpy"]
NIXL_VENV = REPO_ROOT / ".venvs" / "peer-nixl"
# UCX transports per wire: "tcp" over loopback, "shm" through shared memory (cma/posix). Shared
# memory works only with tcp also listed: NIXL asks UCX for peer-failure handling, which the
# shared-memory transports lack on their own (ENVIRONMENT.md).
UCX_TLS = {"tcp": "tcp,self", "shm": "sm,self,tcp"}


def ucx_env(wire: str) -> dict[str, str]:
    """The environment of a NIXL process moving bytes over `wire` ("tcp" or "shm")."""
    env = {
        **os.environ,
        # Without it UCX loads its InfiniBand module, and every process segfaults at exit.
        "UCX_MODULES": "^ib",
        "UCX_TLS": UCX_TLS[wire],
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    if wire == "tcp":
        env["UCX_NET_DEVICES"] = "lo"
    return env


def _resolves(python: Path) -> str:
    code = "import nixl_cu12, nixl_cu12._api; print(nixl_cu12.__file__)"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/",
                         env=ucx_env("tcp"))
    return out.stdout.strip() if out.returncode == 0 else f"FAILED: {out.stderr.strip()[-800:]}"


def ensure_nixl_venv(venv: Path = NIXL_VENV) -> Path:
    """Create (once) NIXL's venv and return its python. Idempotent: a complete venv is reused."""
    python = peer_python(venv)
    marker = venv / ".complete"
    if marker.exists() and python.exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", NIXL, *EXTRA_PACKAGES],
                   check=True, cwd="/")
    resolved = _resolves(python)
    if resolved.startswith("FAILED"):
        raise RuntimeError(f"peer venv {venv}: nixl_cu12 does not import: {resolved}")
    marker.write_text(resolved + "\n")
    return python


if __name__ == "__main__":
    py = ensure_nixl_venv()
    print(py)
    print(_resolves(py))
