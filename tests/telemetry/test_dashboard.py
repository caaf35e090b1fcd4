"""The chart's Grafana dashboard reads only metrics that exist: every series name in every
panel's PromQL is one the engine, the router or the operator registers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfleet.operator import metrics_scraper
from kvfleet.telemetry.metric_names import ROUTER_HELD_REQUESTS
from tests.support.promql import metric_names, registered

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "kvfleet" / "dashboards/kvfleet.json"


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
    signals = {*metrics_scraper.ENGINE_REQUIRED, ROUTER_HELD_REQUESTS}
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
