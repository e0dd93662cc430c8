"""Hand-written JSON schemas for the three Prometheus Operator kinds the chart renders.

They are CRDs, so the Kubernetes schemas of kubernetes-validate do not cover them. These check
the fields the chart uses, by the operator's `monitoring.coreos.com/v1` API (names, types and the
duration pattern as in its published CRDs), and refuse unknown fields; they are a minimal
subset, not the operator's full schema.
"""

from __future__ import annotations

DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
STRMAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": STRMAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}},
    },
}
NAMESPACE_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
}
SCRAPE_ENDPOINT = {
    "type": "object", "additionalProperties": False,
    "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": DURATION,
                   "scrapeTimeout": DURATION, "scheme": {"enum": ["http", "https"]},
                   "honorLabels": {"type": "boolean"},
                   "relabelings": {"type": "array", "items": {
                       "type": "object", "additionalProperties": False,
                       "properties": {"sourceLabels": {"type": "array", "items": {"type": "string"}},
                                      "separator": {"type": "string"}, "targetLabel": {"type": "string"},
                                      "regex": {"type": "string"}, "replacement": {"type": "string"},
                                      "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop",
                                                          "labelkeep", "hashmod"]}}}}},
}
METADATA = {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253},
                   "namespace": {"type": "string"}, "labels": STRMAP, "annotations": STRMAP},
}


def _kind(kind: str, spec: dict) -> dict:
    return {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": kind},
                       "metadata": METADATA, "spec": spec},
    }


RULE = {
    "type": "object", "additionalProperties": False, "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {"record": {"type": "string"}, "alert": {"type": "string"},
                   "expr": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]},
                   "for": DURATION, "keep_firing_for": DURATION, "labels": STRMAP, "annotations": STRMAP},
}

SCHEMAS = {
    "ServiceMonitor": _kind("ServiceMonitor", {
        "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
        "properties": {"selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
                       "endpoints": {"type": "array", "minItems": 1, "items": SCRAPE_ENDPOINT},
                       "jobLabel": {"type": "string"}},
    }),
    "PodMonitor": _kind("PodMonitor", {
        "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
        "properties": {"selector": LABEL_SELECTOR, "namespaceSelector": NAMESPACE_SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": SCRAPE_ENDPOINT},
                       "jobLabel": {"type": "string"}},
    }),
    "PrometheusRule": _kind("PrometheusRule", {
        "type": "object", "additionalProperties": False, "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "rules"],
            "properties": {"name": {"type": "string", "minLength": 1}, "interval": DURATION,
                           "limit": {"type": "integer"}, "rules": {"type": "array", "items": RULE}}}}},
    }),
}
