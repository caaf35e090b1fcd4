"""The series kvfleet registers, the series names a PromQL expression reads, and the shape of a
PrometheusRule: what the dashboard and the alerting rules are held to."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import prometheus_client
import torch
from prometheus_client import CollectorRegistry

import kvfleet.operator.main  # noqa: F401  (registers the operator's metrics)
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.router.breaker import BreakerPolicy, Breakers
from kvfleet.router.proxy import Balancer, RouterMetrics
from tests.support.engine import idle_stats

# The series a metric family of each type is queried by.
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                 "or", "unless", "offset", "inf", "nan"}  # fmt: skip


def _series(registry: CollectorRegistry) -> set[str]:
    return {
        family.name + suffix
        for family in registry.collect()
        for suffix in _SUFFIXES.get(family.type, ("",))
    }


def registered() -> set[str]:
    """Every series name the engine, the router and the operator register."""
    stats = idle_stats()
    engine = EngineMetrics(EngineArgs(model="unused").for_device(torch.device("cpu")), "m")
    engine.collect_state(lambda: stats)
    router = RouterMetrics(Balancer(), Breakers(BreakerPolicy()), "tokens")
    operator = {n for n in _series(prometheus_client.REGISTRY) if n.startswith("kvfleet_")}
    return _series(engine.registry) | _series(router.registry) | operator


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: what is left once strings, label matchers,
    ranges, grouping clauses, function calls, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"`[^`]*`", "", expr)  # raw strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"(?<![\w:.])\d[\w.]*", " ", expr)  # numbers and durations (1e3, 5m)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w:])[A-Za-z_:][\w:]*(\s*\()?", expr):
        word = match.group(0).rstrip("( \t")
        if match.group(1) or word.lower() in _PROMQL_WORDS or word.startswith("$"):
            continue
        names.add(word)
    return names


# The Prometheus Operator's duration: units in order, each at most once.
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
# The shape of a monitoring.coreos.com/v1 PrometheusRule as the Prometheus Operator's CRD
# defines it, for the fields the chart writes (its CRD is not among Kubernetes' schemas).
RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "rules": {"type": "array", "minItems": 1, "items": {"$ref": "#/rule"}},
                        },
                    },
                }
            },
        },
    },
    "rule": {
        "type": "object",
        "required": ["expr"],
        "additionalProperties": False,
        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
        "properties": {
            "alert": {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
            "record": {"type": "string", "pattern": r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
            "expr": {"type": "string", "minLength": 1},
            "for": {"type": "string", "pattern": DURATION},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    },
}


def validate_prometheus_rule(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, RULE_SCHEMA)
