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


# Labels every scraped series carries besides its own: Prometheus's job and instance, and the
# worker's role that deploy/prometheus/prometheus.yml and the chart's monitors add. A series' own
# `instance` label (the conductor's per-worker families) is kept as `exported_instance`.
TARGET_LABELS = frozenset({"job", "instance", "role"})
COUNTER_LIKE = ("_total", "_bucket", "_sum", "_count")


def exported_labels(text: str, metrics_objects=()) -> dict[str, frozenset[str]]:
    """Series name -> the label names it carries once scraped, from a /metrics text's samples and
    from prometheus_client metric objects (whose labelled families may have no child yet)."""
    from prometheus_client.metrics import MetricWrapperBase

    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    for obj in metrics_objects:
        for metric in vars(obj).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(metric._type, ("",))
            for suffix in suffixes:
                names = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
                found.setdefault(metric._name + suffix, set()).update(names)
    return {name: frozenset({"exported_instance" if label == "instance" else label for label in names} | TARGET_LABELS)
            for name, names in found.items()}


def _carried(node, labels: dict[str, frozenset[str]]) -> frozenset[str] | None:
    """The labels a parsed node's result may carry (None: any: a series not in `labels`)."""
    if isinstance(node, promql_parser.VectorSelector):
        return labels.get(node.name) if node.name else None
    if isinstance(node, promql_parser.MatrixSelector):
        return _carried(node.vector_selector, labels)
    if isinstance(node, promql_parser.AggregateExpr):
        inner = _carried(node.expr, labels)
        grouped = frozenset(node.modifier.labels) if node.modifier is not None else frozenset()
        if node.modifier is not None and node.modifier.type == promql_parser.AggModifierType.By:
            return grouped
        return None if inner is None else inner - grouped
    if isinstance(node, promql_parser.Call):
        vectors = [_carried(a, labels) for a in node.args
                   if not isinstance(a, (promql_parser.NumberLiteral, promql_parser.StringLiteral))]
        result = vectors[-1] if vectors else frozenset()
        return result - {"le"} if node.func.name == "histogram_quantile" and result is not None else result
    if isinstance(node, promql_parser.BinaryExpr):
        sides = [_carried(node.lhs, labels), _carried(node.rhs, labels)]
        return None if None in sides else sides[0] | sides[1]
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return _carried(node.expr, labels)
    return frozenset()  # a number or a string


def result_labels(expr: str, labels: dict[str, frozenset[str]]) -> frozenset[str] | None:
    """The labels an expression's result may carry (None: any)."""
    return _carried(promql_parser.parse(_GRAFANA_INTERVALS.sub("5m", expr)), labels)


def label_problems(expr: str, labels: dict[str, frozenset[str]]) -> list[str]:
    """What an expression asks of the series it reads that they cannot give: a matcher or a
    grouping label none of them carries, rate()/increase() of a gauge, histogram_quantile over
    buckets that lost their `le`. A series not in `labels` (a recording rule's, Prometheus's own
    `up`) may carry any label."""
    problems: list[str] = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector) and node.name in labels:
            for matcher in node.matchers.matchers:
                if matcher.name != "__name__" and matcher.name not in labels[node.name]:
                    problems.append(f"{node.name} has no label {matcher.name!r}")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            inner = _carried(node.expr, labels)
            problems.extend(f"{node.op} by/without {label!r}: not a label of what it aggregates"
                            for label in node.modifier.labels if inner is not None and label not in inner)
        elif isinstance(node, promql_parser.Call):
            name = node.func.name
            if name in ("rate", "irate", "increase"):
                selector = node.args[0].vector_selector
                if selector.name in labels and not selector.name.endswith(COUNTER_LIKE):
                    problems.append(f"{name}() of {selector.name}, which is not a counter")
            if name == "histogram_quantile":
                inner = _carried(node.args[1], labels)
                if inner is not None and "le" not in inner:
                    problems.append("histogram_quantile over a vector without its 'le' label")
        return True

    promql_parser.walk(promql_parser.parse(_GRAFANA_INTERVALS.sub("5m", expr)), visit)
    return problems


def legend_labels(legend: str | None) -> set[str]:
    """The labels a Grafana legend format names ({{label}})."""
    return set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend or ""))
