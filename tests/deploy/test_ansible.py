"""deploy/ansible: the playbooks parse and lint clean, render systemd units that systemd accepts
and that the real CLI parses, and (heavy) a real run against this machine brings up etcd and a
cluster that answers an OpenAI request, a second run changes nothing, and teardown.yml leaves no
process behind. All state lives in a temp dir; the run uses the checkout's venv and model."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from mooncake import defaults
from mooncake.cli import build_parser
from tests.conftest import MODEL_NAME
from tests.processes import ROOT, free_port

PLAYBOOKS = ROOT / "deploy" / "ansible"
BIN = Path(sys.executable).parent
RECAP = re.compile(r"^localhost\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def cli_takes(command: str, option: str) -> bool:
    """Whether this checkout's `mooncake COMMAND` has OPTION (the cluster token and API key files
    came with the auth work; the playbook asks the installed command the same question)."""
    return not build_parser().parse_known_args([command, option, "x"])[1]


HAS_TOKEN, HAS_KEYS = cli_takes("conductor", "--cluster-token-file"), cli_takes("conductor", "--api-keys-file")


@dataclass
class Recap:
    ok: int
    changed: int
    failed: int
    output: str


def ansible_env(root: Path, deploy: Path | None = None) -> dict[str, str]:
    """Ansible's own files (tmp, caches) under `root`, the deployment's under `deploy`; the venv's
    tools first on PATH."""
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "MOONCAKE_DEPLOY_ROOT": str(deploy or root / "deploy"),
            "ANSIBLE_HOME": str(root / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(root / "ansible-tmp"),
            "ANSIBLE_REMOTE_TEMP": str(root / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1", "XDG_CACHE_HOME": str(root / "cache")}


def playbook(root: Path, name: str, extra_vars: dict, *args: str, deploy: Path | None = None,
             timeout: float = 900) -> Recap:
    vars_file = root / "extra-vars.json"
    vars_file.write_text(json.dumps(extra_vars))
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", "inventory/local", name, "-e", f"@{vars_file}", *args],
                          cwd=PLAYBOOKS, env=ansible_env(root, deploy), capture_output=True, text=True, timeout=timeout)
    match = RECAP.search(proc.stdout)
    assert proc.returncode == 0 and match, f"{name} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    ok, changed, _, failed = map(int, match.groups())
    return Recap(ok, changed, failed, proc.stdout)


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """The service's command parsed by `mooncake`'s own parser: every option must be one it takes."""
    namespace, unknown = build_parser().parse_known_args(argv)
    assert not unknown, f"options `mooncake {argv[0]}` does not take: {unknown}"
    return namespace


# --- fast --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["site.yml", "teardown.yml"])
@pytest.mark.parametrize("inventory", ["inventory/local", "inventory/example"])
def test_playbooks_pass_the_syntax_check(name, inventory, tmp_path):
    proc = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", inventory, name], cwd=PLAYBOOKS,
                          env=ansible_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ansible_lint_passes_the_production_profile(tmp_path):
    proc = subprocess.run([str(BIN / "ansible-lint"), "--nocolor"], cwd=PLAYBOOKS, env=ansible_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "Profile 'production' was required, and it passed" in proc.stderr, proc.stderr[-2000:]


def test_cli_flags_leaves_out_unset_options():
    spec = importlib.util.spec_from_file_location("mooncake_cli_filter", PLAYBOOKS / "filter_plugins" / "mooncake_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    flags = module.FilterModule().filters()["cli_flags"]
    assert flags({"port": 8000, "ttft-slo": None, "dtype": "", "no-x": False, "y": True, "url": ["a", "b"]}) == [
        "--port", "8000", "--y", "--url", "a", "--url", "b"]


def test_role_ports_are_the_commands_defaults():
    text = {role: (PLAYBOOKS / "roles" / role / "defaults" / "main.yml").read_text() for role in ("conductor", "prefill", "decode")}
    for role, port in (("conductor", defaults.CONDUCTOR_PORT), ("prefill", defaults.PREFILL_PORT), ("decode", defaults.DECODE_PORT)):
        assert re.search(rf"^{role}_port: {port}\b", text[role], re.M), f"{role}_port is not {port} (mooncake/defaults.py)"


def test_rendered_units_are_valid_and_run_options_the_cli_takes(tmp_path):
    """A run that installs and starts nothing (the checkout's venv has the project): it writes
    systemd units, which systemd-analyze verifies and whose commands `mooncake`'s parser reads,
    and the secrets files."""
    root = tmp_path
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    recap = playbook(root, "site.yml", {
        "mooncake_service_manager": "systemd", "mooncake_start_services": False, "mooncake_venv": sys.prefix,
        "mooncake_model": "/srv/models/SmolLM2-135M-Instruct", "mooncake_dtype": "bfloat16", "etcd_install_package": False,
        "etcd_binary": etcd, "conductor_ttft_slo": 10, "conductor_port": 8300, "prefill_cpu_bind": "0-3",
        "mooncake_pool_dram_gib": 1.5, "mooncake_pool_ssd_dir": str(root / "ssd"),
        **({"mooncake_cluster_token": "t0ken-for-the-test"} if HAS_TOKEN else {}),
        **({"mooncake_api_keys": ["sk-one", "sk-two SmolLM2-135M-Instruct"]} if HAS_KEYS else {})},
        "--skip-tags", "install", timeout=300)
    assert recap.failed == 0
    deploy = root / "deploy"
    units = {p.stem: p for p in (deploy / "systemd").glob("*.service")}
    assert set(units) == {"mooncake-etcd", "mooncake-conductor", "mooncake-prefill", "mooncake-decode"}
    assert not (deploy / "etc" / "supervisord.conf").exists()  # nothing started, no stand-in

    token_file, keys_file = deploy / "etc" / "cluster-token", deploy / "etc" / "api-keys"
    assert token_file.exists() == HAS_TOKEN and keys_file.exists() == HAS_KEYS
    if HAS_TOKEN:
        assert token_file.read_text() == "t0ken-for-the-test\n" and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    if HAS_KEYS:
        assert keys_file.read_text() == "sk-one\nsk-two SmolLM2-135M-Instruct\n"
        assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    for role in ("conductor", "prefill", "decode"):
        settings = unit_settings(units[f"mooncake-{role}"])
        argv = shlex.split(settings["ExecStart"][0])
        assert argv[0] == f"{sys.prefix}/bin/mooncake" and argv[1] == role
        namespace = parse_cli(argv[1:])
        assert namespace.model == "/srv/models/SmolLM2-135M-Instruct" and namespace.dtype == "bfloat16"
        assert namespace.registry.startswith("etcd://127.0.0.1:")
        assert getattr(namespace, "cluster_token_file", None) == (str(token_file) if HAS_TOKEN else None)
        assert getattr(namespace, "api_keys_file", None) == (str(keys_file) if HAS_KEYS and role == "conductor" else None)
        env = dict(shlex.split(e)[0].split("=", 1) for e in settings["Environment"])
        assert env["MOONCAKE_CACHE_DIR"] and env["HOME"] == str(deploy / "state")
        # SIGTERM reaches the main process only (it drains while vLLM's engine keeps serving), and
        # SIGKILL waits longer than the drain.
        assert settings["KillMode"] == ["mixed"]
        assert float(settings["TimeoutStopSec"][0]) >= namespace.drain_timeout + 10
    conductor = parse_cli(shlex.split(unit_settings(units["mooncake-conductor"])["ExecStart"][0])[1:])
    assert conductor.port == 8300 and conductor.ttft_slo == 10
    prefill = parse_cli(shlex.split(unit_settings(units["mooncake-prefill"])["ExecStart"][0])[1:])
    assert prefill.cpu_bind == "0-3" and prefill.instance_id == "prefill-localhost"
    # Each worker's pool: the DRAM tier given, an SSD folder of its own (created), the command's cap.
    decode = parse_cli(shlex.split(unit_settings(units["mooncake-decode"])["ExecStart"][0])[1:])
    for role, worker in (("prefill", prefill), ("decode", decode)):
        assert worker.pool_dram_gib == 1.5 and worker.pool_ssd_dir == str(root / "ssd" / role)
        assert worker.pool_ssd_shared_by == 2  # both roles on this one host: one disk, two pools
        assert (root / "ssd" / role).is_dir()
    assert prefill.pool_ssd_gib == parse_cli(["prefill"]).pool_ssd_gib  # not set: the command's default

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing: `make helm-tools` installs it")
        pytest.skip("systemd-analyze not installed: the units' commands were checked, not the unit files")
    checked = [p for name, p in units.items() if name != "mooncake-etcd" or os.access(etcd, os.X_OK)]
    proc = subprocess.run([analyze, "verify", "--man=no", *map(str, checked)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


def test_install_tasks_put_the_project_into_a_fresh_venv_once(tmp_path):
    """The install tasks for real, minus the heavy dependencies (--no-deps): a new venv gets
    mooncake-serve from the checkout; a second run finds it and installs nothing."""
    # pip builds a source folder in place (build/, *.egg-info): give it a copy, not the checkout.
    source = shutil.copytree(ROOT, tmp_path / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".cache", ".whl", "build", "*.egg-info", "out", "__pycache__", ".pytest_cache"))
    install = {"mooncake_venv": str(tmp_path / "venv"), "mooncake_package": str(source), "mooncake_extras": "",
               "mooncake_pip_extra_args": "--no-deps", "mooncake_pip_preinstall": [], "mooncake_pip_remove": [],
               "mooncake_model": "/srv/models/any", "mooncake_start_services": False}
    first = playbook(tmp_path, "site.yml", install, "--tags", "install", timeout=300)
    assert first.failed == 0 and first.changed == 1, first.output[-4000:]
    assert (tmp_path / "venv" / "bin" / "mooncake").is_file()
    second = playbook(tmp_path, "site.yml", install, "--tags", "install", timeout=300)
    assert second.failed == 0 and second.changed == 0, second.output[-4000:]


# --- heavy: a real run against this machine ---------------------------------------------------

def supervised_processes(deploy: Path) -> list[psutil.Process]:
    """supervisord and everything under it (the services and vLLM's engine processes)."""
    try:
        top = psutil.Process(int((deploy / "state" / "supervisor" / "supervisord.pid").read_text()))
        return [top, *top.children(recursive=True)]
    except (OSError, ValueError, psutil.Error):
        return []


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_all(processes: list[psutil.Process]) -> None:
    for p in processes:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def program_command(deploy: Path, name: str) -> list[str]:
    text = (deploy / "etc" / "supervisor.d" / f"{name}.conf").read_text()
    return shlex.split(re.search(r"^command=(.*)$", text, re.M).group(1).replace("%%", "%"))


@pytest.mark.vllm
@pytest.mark.etcd
def test_site_playbook_deploys_a_cluster_reruns_without_changes_and_tears_down(tmp_path, model_path):
    ports = {name: free_port() for name in ("conductor_port", "prefill_port", "prefill_kv_port", "decode_port",
                                            "decode_kv_port", "etcd_client_port", "etcd_peer_port")}
    api_key = "sk-from-the-playbook"
    # The supervisord stand-in even where systemd is PID 1: the units would go to a folder systemd
    # never reads, and this run must not need root.
    extra_vars = {**ports, "mooncake_service_manager": "supervisor", "mooncake_venv": sys.prefix,
                  "mooncake_package": str(ROOT),
                  "mooncake_cache_dir": str(Path(model_path).parents[1]), "conductor_wait_timeout": 600,
                  "mooncake_api_keys": [api_key] if HAS_KEYS else []}
    # A short path: supervisord's socket lives in it (AF_UNIX paths end at 107 bytes).
    deploy = Path(tempfile.mkdtemp(prefix="mooncake-ansible-"))
    leftovers: list[psutil.Process] = []
    try:
        first = playbook(tmp_path, "site.yml", extra_vars, deploy=deploy)
        assert first.failed == 0 and first.changed > 0
        base = f"http://127.0.0.1:{ports['conductor_port']}"
        health = httpx.get(base + "/health", timeout=10).json()
        assert {(w["instance_id"], w["status"]) for w in health["workers"]} == {
            ("prefill-localhost", "ready"), ("decode-localhost", "ready")}, health
        assert health["registry"]["url"] == f"etcd://127.0.0.1:{ports['etcd_client_port']}"
        assert health["registry"]["instances"] == 2 and health["registry"]["outage_since"] is None
        for name in ("mooncake-conductor", "mooncake-prefill", "mooncake-decode"):
            command = parse_cli(program_command(deploy, name)[1:])  # the supervisor runs what the CLI takes
            # Where the CLI takes a cluster token, the playbook made one and gave it to every process.
            assert getattr(command, "cluster_token_file", None) == (str(deploy / "etc" / "cluster-token") if HAS_TOKEN else None)

        client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120)
        if HAS_KEYS:
            with pytest.raises(openai.AuthenticationError):
                client.with_options(api_key="sk-not-a-key").models.list()
        answer = client.chat.completions.create(model=MODEL_NAME, max_tokens=16, temperature=0,
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content, answer

        before = {p.pid for p in supervised_processes(deploy)}
        second = playbook(tmp_path, "site.yml", extra_vars, deploy=deploy)
        assert second.failed == 0 and second.changed == 0, second.output[-6000:]
        leftovers = supervised_processes(deploy)
        assert {p.pid for p in leftovers} == before  # nothing was restarted
    finally:
        leftovers = leftovers or supervised_processes(deploy)
        try:
            down = playbook(tmp_path, "teardown.yml", extra_vars, deploy=deploy, timeout=300)
            # The services drained and exited on SIGTERM; vLLM's engine processes follow their parent.
            _, still = psutil.wait_procs(leftovers, timeout=30)
            open_ports = [name for name, port in ports.items() if port_open(port)]
            programs_left = sorted(p.name for p in (deploy / "etc").rglob("*.conf"))
            again = playbook(tmp_path, "teardown.yml", extra_vars, deploy=deploy, timeout=300)
        finally:
            kill_all([p for p in leftovers if alive(p)])  # a safety net; the assertions below say if it was needed
            if (deploy / "log").is_dir():
                shutil.copytree(deploy / "log", tmp_path / "logs")  # for whoever reads a failure
            shutil.rmtree(deploy, ignore_errors=True)
    assert down.failed == 0 and down.changed > 0
    assert not [p for p in still if alive(p)], f"teardown.yml left {[(p.pid, p.name()) for p in still]}"
    assert not open_ports, open_ports
    assert not programs_left, programs_left  # supervisord.conf and every program file are gone
    assert again.failed == 0 and again.changed == 0, again.output[-4000:]
