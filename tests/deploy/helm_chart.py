"""Rendering the Helm chart (deploy/helm/mooncake) without helm, and reading what it renders:
shared by test_helm_chart.py (every object valid, the values schema, the files it carries) and
test_helm_wiring.py (what selects what, probes, tokens, etcd, drain, command lines)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from mooncake import defaults
from tests.deploy.monitoring_schemas import SCHEMAS as MONITORING_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "mooncake"
RENDER_SOURCE = ROOT / "deploy" / "helm" / "render"
RULE_FILES = ("recording.yml", "alerts.yml")
DASHBOARD = ROOT / "deploy" / "grafana" / "mooncake-dashboard.json"
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())  # the chart's kubeVersion floor; the newest
MOONCAKE_COMPONENTS = ("conductor", "prefill", "decode")
SECRETS_DIR = "/etc/mooncake/secrets"  # the chart's mooncake.secretsDir
# A worker or conductor drains for up to this long on SIGTERM; Kubernetes must not kill it sooner.
DRAIN_TIMEOUT_S = defaults.DRAIN_TIMEOUT_S

VARIANTS = {
    "default": None,
    "all-options": CHART / "ci" / "all-options-values.yaml",
    # The alternatives all-options cannot hold at once.
    "external": {
        "etcd": {"enabled": False, "externalEndpoint": "http://etcd.infra.svc:2379"},
        "auth": {"existingSecret": "mooncake-secrets", "existingSecretHasApiKeys": True},
        "conductor": {"replicas": 1, "preStopSleepSeconds": 0},
        "model": {"path": "/models/m", "volume": {"hostPath": {"path": "/srv/models", "type": "Directory"}}},
        "store": {"ssd": {"enabled": True, "type": "hostPath", "hostPath": "/mnt/nvme/mooncake"}},
        "metrics": {"monitor": "PodMonitor", "rulesConfigMap": {"enabled": False}},
    },
    "cpu": {
        "prefill": {"replicas": 0, "gpusPerPod": 0},
        "decode": {"gpusPerPod": 0, "cpuBind": "0-3", "resources": {"limits": {"cpu": "4"}}},
        "store": {"dramGib": 1.5, "ssd": {"enabled": True, "type": "emptyDir", "size": "20Gi", "capacityGib": 16}},
        "metrics": {"dashboardConfigMap": {"enabled": False}, "monitor": ""},
    },
}



def build_renderer(out: Path) -> Path:
    """Builds deploy/helm/render into `out` (GOPATH mode against Debian's Go sources: no module
    download, no network) and returns the binary."""
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the `go` toolchain is missing: `make helm-tools` installs it and the sprig library")
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": "/usr/share/gocode", "GOCACHE": str(out / "cache")}
    build = subprocess.run([go, "build", "-o", str(out / "render"), "."], cwd=RENDER_SOURCE, env=env,
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise RuntimeError(f"the renderer did not build: {build.stderr}")
    return out / "render"


def run_renderer(renderer: Path, overlay, tmp_path: Path, *flags: str, chart: Path = CHART):
    files = []
    if isinstance(overlay, Path):
        files = ["-f", str(overlay)]
    elif overlay is not None:
        path = tmp_path / "overlay.yaml"
        path.write_text(yaml.safe_dump(overlay))
        files = ["-f", str(path)]
    return subprocess.run([str(renderer), *flags, *files, str(chart)], capture_output=True, text=True)


def merged_values(renderer: Path, overlay, tmp_path: Path) -> dict:
    """The values the templates see: the chart's, with the overlay laid over them as Helm does."""
    out = run_renderer(renderer, overlay, tmp_path, "-show-values")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def render(renderer: Path, overlay, tmp_path: Path) -> tuple[list[dict], dict]:
    """(the rendered objects, the merged values the templates saw)."""
    out = run_renderer(renderer, overlay, tmp_path)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None], merged_values(renderer, overlay, tmp_path)


def validate_object(obj: dict) -> None:
    schema = MONITORING_SCHEMAS.get(obj["kind"])
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(obj)
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# --- reading the rendered objects --------------------------------------------------------------

def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def component(obj) -> str | None:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def workloads(docs):
    return {component(d): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def pod_labels(workload):
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def args_of(container) -> list[str]:
    return container.get("args", [])


def option(args, name) -> str | None:
    values = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return values[-1] if values else None


def port_number(container, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)
