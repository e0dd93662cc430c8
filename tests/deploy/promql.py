"""What the dashboard and the rules query, and what the processes export, as metric names.

Shared by tests/deploy/test_dashboard.py (names from registries built in-process) and
tests/e2e/test_metrics_counts.py (names from a real cluster's scrapes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "mooncake-dashboard.json"
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
PROMETHEUS_OWN = {"up"}  # written by Prometheus itself for every target

# Grafana's built-in interval variables, replaced by a duration before parsing.
_GRAFANA_INTERVALS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}")


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' panels included."""
    dashboard = json.loads(path.read_text())
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels += panel.get("panels", [])
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def rules(paths=RULE_FILES) -> list[dict]:
    return [rule for path in paths for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


def recording_rule_names(paths=RULE_FILES) -> set[str]:
    return {rule["record"] for rule in rules(paths) if "record" in rule}


def metric_names(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects (by name or by a __name__ matcher)."""
    parsed = promql_parser.parse(_GRAFANA_INTERVALS.sub("5m", expr))
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            names.update(m.value for m in node.matchers.matchers if m.name == "__name__")
        return True

    promql_parser.walk(parsed, visit)
    return names


def exported_names(text: str) -> set[str]:
    """The series names a /metrics text exports, with the names its families would have once
    their first labelled child exists (a labelled family with no child shows only # HELP/# TYPE)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_count", "_sum"))
        else:
            names.add(family.name)
    return names
