"""The chart's Grafana dashboard reads only metrics that exist: every series name in every
panel's PromQL is one the engine, the router or the operator registers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

import kvfleet.operator.main  # noqa: F401  (registers the operator's metrics)
from kvfleet.engine.config import EngineArgs
from kvfleet.engine.metrics import EngineMetrics
from kvfleet.engine.outputs import EngineStats
from kvfleet.operator import metrics_scraper
from kvfleet.router.breaker import BreakerPolicy, Breakers
from kvfleet.router.proxy import Balancer, RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvfleet" / "dashboards/kvfleet.json"
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
    stats = EngineStats(**dict.fromkeys(EngineStats.__dataclass_fields__, 0))
    engine = EngineMetrics(EngineArgs(model="unused"), "m")
    engine.collect_state(lambda: stats)
    router = RouterMetrics(Balancer(), Breakers(BreakerPolicy()), "tokens")
    operator = {n for n in _series(prometheus_client.REGISTRY) if n.startswith("kvfleet_")}
    return _series(engine.registry) | _series(router.registry) | operator


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: what is left once strings, label matchers,
    ranges, grouping clauses, function calls, keywords and numbers are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
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


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            # Grafana's label_values(<series selector>, <label>): the selector is PromQL.
            query = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"]["query"])
            assert query, var["query"]
            yield f"variable {var['name']}", query.group(1)


def test_metric_names_are_found_in_promql():
    expr = (
        'histogram_quantile(0.95, sum by (le) (rate(a:b_bucket{x=~"$x", y!="c d"}[5m]))) '
        "/ on (pod) group_left count without (z) (c_total offset 5m) > bool 1e3"
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total"}


def test_every_panel_reads_registered_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    known = registered()
    assert "vllm:time_to_first_token_seconds_bucket" in known  # the registries were read
    unknown = {
        (where, name)
        for where, expr in _queries(dashboard)
        for name in metric_names(expr)
        if name not in known
    }
    assert not unknown, f"the dashboard queries series nothing registers: {sorted(unknown)}"
    for where, expr in _queries(dashboard):
        assert metric_names(expr), f"{where}: {expr} reads no metric"


def test_the_dashboard_shows_what_the_autoscaler_reads():
    dashboard = json.loads(DASHBOARD.read_text())
    used = {n for _, expr in _queries(dashboard) for n in metric_names(expr)}
    signals = {metrics_scraper.RUNNING, metrics_scraper.WAITING, metrics_scraper.KV_CACHE_USAGE,
               metrics_scraper.HELD_REQUESTS}  # fmt: skip
    assert signals <= used
    assert {"kvfleet_operator_autoscaling_failures_total",
            "kvfleet_operator_scrape_failures_total"} <= used  # fmt: skip


@pytest.mark.parametrize("key", ["uid", "title", "schemaVersion"])
def test_the_dashboard_is_importable(key):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard[key]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}" and panel["description"]
