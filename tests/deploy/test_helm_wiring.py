"""The Helm chart's wiring, on the rendered objects of every values set (tests/deploy/helm_chart.py):
what selects what, which port a probe hits, where the token is mounted, which registry each
process uses, how termination leaves time to drain, GPUs and spreading, the store's volume, and
that every command line parses with the real `mooncake` CLI.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from mooncake import defaults
from tests.deploy.helm_chart import (
    CHART, MOONCAKE_COMPONENTS, SECRETS_DIR, DRAIN_TIMEOUT_S, VARIANTS, run_renderer, render,
    by_kind, component, workloads, pod_spec, pod_labels, selects, args_of, option, port_number,
)


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
    """Mounted in every worker when enabled, and the worker's pool pointed at it; the pool's DRAM
    tier and SSD capacity reach the command line when set."""
    docs, values = render(renderer, VARIANTS[variant], tmp_path)
    ssd = values["store"]["ssd"]
    for role in ("prefill", "decode"):
        workload = workloads(docs).get(role)
        if workload is None:
            continue
        container = pod_spec(workload)["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        sub_paths = {m["name"]: m.get("subPathExpr") for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        claims = [c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])]
        args = args_of(container)
        assert option(args, "--pool-dram-gib") == (str(values["store"]["dramGib"]) if values["store"]["dramGib"] else None)
        if not ssd["enabled"]:
            assert "store-ssd" not in mounts and "store-ssd" not in claims
            assert option(args, "--pool-ssd-dir") is None and option(args, "--pool-ssd-gib") is None
            continue
        assert mounts["store-ssd"] == ssd["mountPath"] == option(args, "--pool-ssd-dir")
        assert option(args, "--pool-ssd-gib") == (str(ssd["capacityGib"]) if ssd["capacityGib"] else None)
        if ssd["type"] == "persistentVolumeClaim":
            claim = workload["spec"]["volumeClaimTemplates"][0]
            assert claim["spec"]["resources"]["requests"]["storage"] == ssd["size"]
            assert "store-ssd" not in volumes
        else:
            assert ssd["type"] in volumes["store-ssd"] and "store-ssd" not in claims
        # A node's host directory is shared by its worker pods: each pool its own subdirectory.
        assert (sub_paths["store-ssd"] == "$(POD_NAME)") == (ssd["type"] == "hostPath")
        assert any(e["name"] == "POD_NAME" for e in container["env"])
    assert run_renderer(renderer, {"store": {"ssd": {"enabled": True, "type": "hostPath"}}},
                        tmp_path).returncode != 0  # a hostPath volume needs its path


def _relabelled(rules: list[dict], pod: dict[str, str]) -> dict[str, str]:
    """Prometheus' `replace` relabelling of a target whose pod has labels `pod` (kubernetes_sd
    exposes each as __meta_kubernetes_pod_label_<name, non-alphanumerics as _>)."""
    import re
    meta = {"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in pod.items()}
    out = {}
    for rule in rules:
        assert rule.get("action", "replace") == "replace"
        value = rule.get("separator", ";").join(meta.get(s, "") for s in rule["sourceLabels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            out[rule["targetLabel"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return out


@pytest.mark.parametrize("monitor", ["ServiceMonitor", "PodMonitor"])
def test_monitors_label_each_worker_with_its_role(renderer, tmp_path, monitor):
    # The recording rules sum worker throughput by role, as prometheus.yml labels it; the
    # InstanceDown alert and the dashboard select by prometheus.yml's job names, which a monitor
    # would otherwise take from the release's names.
    docs, _ = render(renderer, {"metrics": {"monitor": monitor}, "nameOverride": "mc"}, tmp_path)
    (mon,) = by_kind(docs, monitor)
    endpoints = mon["spec"]["endpoints" if monitor == "ServiceMonitor" else "podMetricsEndpoints"]
    pods = workloads(docs)
    for endpoint in endpoints:
        rules = endpoint.get("relabelings", [])
        for role in ("prefill", "decode"):
            assert _relabelled(rules, pod_labels(pods[role])).get("role") == role
            assert _relabelled(rules, pod_labels(pods[role])).get("job") == "mooncake-worker"
        assert "role" not in _relabelled(rules, pod_labels(pods["conductor"]))
        assert _relabelled(rules, pod_labels(pods["conductor"])).get("job") == "mooncake-conductor"
