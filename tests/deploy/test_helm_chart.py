"""The Helm chart (deploy/helm/mooncake), rendered and checked without helm or a cluster.

There is no helm binary on these machines, so deploy/helm/render (Go's text/template and the
sprig library, as in Helm, built offline from Debian's packages by `make helm-tools`) renders
the templates (tests/deploy/helm_chart.py). Every object rendered for every values set must
parse and validate against the Kubernetes JSON schema of its kind, strictly (unknown fields
refused), for the oldest Kubernetes the chart supports and the newest kubernetes-validate knows;
the Prometheus Operator's kinds against the minimal schemas in monitoring_schemas.py. The values
validate against values.schema.json; the rules and dashboard ConfigMaps carry deploy/'s files.
The wiring between objects is checked in test_helm_wiring.py.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.helm_chart import (
    ROOT, CHART, RULE_FILES, DASHBOARD, VARIANTS, run_renderer, merged_values, render,
    validate_object, by_kind, component, workloads, pod_spec,
)


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
    {"prefill": {"kvCacheGib": 0.001}},  # smaller than any prompt of the default model
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
    {"prefill": {"gpusPerPod": 2}},  # a worker's engine uses one GPU: a second would sit idle
])
def test_the_schema_refuses_bad_values(renderer, tmp_path, bad):
    values = merged_values(renderer, bad, tmp_path)
    assert list(values_validator().iter_errors(values)), f"accepted {bad}"


# --- wiring ------------------------------------------------------------------------------------


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


def _leaves(values: dict, prefix: tuple = ()):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,)


def test_all_options_sets_every_value():
    """ci/all-options-values.yaml is the worked example the docs point to as "sets every value"."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    example = yaml.safe_load((CHART / "ci" / "all-options-values.yaml").read_text())

    def holds(path: tuple) -> bool:
        node = example
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return False
            node = node[key]
        return True

    assert [".".join(p) for p in _leaves(defaults) if not holds(p)] == []
