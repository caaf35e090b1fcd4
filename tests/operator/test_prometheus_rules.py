"""The chart's PrometheusRule (templates/prometheusrule.yaml), rendered by helm: its groups pass
`promtool check rules`, and `promtool test rules` feeds them series that fire and do not fire
each alert (prometheus_rules.test.yaml); every series they read is one kvfleet registers.

promtool comes from Debian's `prometheus` package, which .ci/run installs. Without it the promtool
tests skip locally and fail under CI=true.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.engine import metrics as engine_metrics
from tests.support.promql import metric_names, registered, validate_prometheus_rule
from tests.support.tools import CHART, helm, run_helm, tool

NAMESPACE = "kvfleet-system"
TESTS = Path(__file__).with_name("prometheus_rules.test.yaml")
ENABLED = {"prometheusRule.enabled": True, "monitoring.operator.enabled": True}
# Numbers as a values file or --set-json give them (--set passes 0.8 as a string).
CUSTOM = ENABLED | {
    "prometheusRule.labels.release": "prometheus",
    "prometheusRule.alertLabels.team": "ml",
    "prometheusRule.kvCacheUsage": 0.8,
    "prometheusRule.waitingPerReplica": 4,
    "prometheusRule.sustainedFor": "5m",
    "prometheusRule.ttftSLO.thresholdSeconds": 5,
    "prometheusRule.ttftSLO.objective": 0.999,
}


def json_args(values: dict[str, Any]) -> list[str]:
    return [
        a for key, value in values.items() for a in ("--set-json", f"{key}={json.dumps(value)}")
    ]


def render(values: dict[str, Any]) -> dict[str, Any]:
    out = helm("template", "kvfleet", str(CHART), "--namespace", NAMESPACE,
               "--show-only", "templates/prometheusrule.yaml", *json_args(values))  # fmt: skip
    (rule,) = [d for d in yaml.safe_load_all(out) if d]
    return rule


def rules(rule: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def alerts(rule: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for r in rules(rule) if "alert" in r}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = tool("promtool", install="apt-get install prometheus (Debian's package has it)",
               required=bool(os.environ.get("CI")))  # fmt: skip
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip


def write_groups(rule: dict[str, Any], path: Path, *, annotations: bool = True) -> Path:
    spec = json.loads(json.dumps(rule["spec"]))
    if not annotations:
        for r in (r for group in spec["groups"] for r in group["rules"]):
            r.pop("annotations", None)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# what is rendered


@pytest.mark.parametrize("values", [ENABLED, CUSTOM], ids=["defaults", "custom"])
def test_the_rule_has_the_shape_of_a_prometheus_rule(values):
    rule = render(values)
    validate_prometheus_rule(rule)
    assert rule["metadata"]["namespace"] == NAMESPACE
    for alert in alerts(rule).values():
        assert alert["labels"]["severity"] in ("critical", "warning")
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def test_the_alerts_an_on_call_engineer_needs():
    assert set(alerts(render(ENABLED))) == {
        "KvfleetEngineDown",
        "KvfleetEngineReplicasUnavailable",
        "KvfleetKVCacheUsageHigh",
        "KvfleetQueueHigh",
        "KvfleetTTFTBudgetBurnFast",
        "KvfleetTTFTBudgetBurnSlow",
        "KvfleetReconcileErrors",
        "KvfleetAutoscalingFailing",
        "KvfleetScaleBlockedAtMaxReplicas",
        "KvfleetOperatorDown",
    }
    # The operator's own scrape is the chart's PodMonitor: without it, no job to watch.
    assert "KvfleetOperatorDown" not in alerts(render({"prometheusRule.enabled": True}))


def test_values_reach_the_rules():
    rule = render(CUSTOM)
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    found = alerts(rule)
    assert all(a["labels"]["team"] == "ml" for a in found.values())
    assert "> 0.8" in found["KvfleetKVCacheUsageHigh"]["expr"]
    assert "> 4" in found["KvfleetQueueHigh"]["expr"]
    assert found["KvfleetQueueHigh"]["for"] == "5m"
    assert "(1 - 0.999)" in found["KvfleetTTFTBudgetBurnFast"]["expr"]


def test_alert_labels_cannot_take_the_severity():
    proc = run_helm("template", "kvfleet", str(CHART), *json_args(ENABLED),
                    "--set", "prometheusRule.alertLabels.severity=page")  # fmt: skip
    assert proc.returncode != 0
    assert "prometheusRule.alertLabels must not set severity" in proc.stderr


@pytest.mark.parametrize(("threshold", "le", "not_le"), [
    (2.5, ["2.5"], ["25", "2.50", "0.25"]),
    # Prometheus 3 stores a whole bound without its ".0"; the engines write "5.0".
    (5, ["5", "5.0"], ["0.5", "50", "7.5"]),
])  # fmt: skip
def test_the_slo_threshold_is_a_bucket_bound_as_either_prometheus_stores_it(threshold, le, not_le):
    rule = render(ENABLED | {"prometheusRule.ttftSLO.thresholdSeconds": threshold})
    recorded = [r for r in rules(rule) if "record" in r]
    assert len(recorded) == 4
    for r in recorded:
        (pattern,) = re.findall(r"le=~`([^`]*)`", r["expr"])
        assert all(re.fullmatch(pattern, v) for v in le), (pattern, le)
        assert not any(re.fullmatch(pattern, v) for v in not_le), (pattern, not_le)


def test_the_threshold_may_only_be_a_bucket_bound_of_the_engines():
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["prometheusRule"]["properties"]["ttftSLO"]["properties"]
    assert slo["thresholdSeconds"]["enum"] == list(engine_metrics._LATENCY_BUCKETS)


def test_every_series_the_rules_read_is_registered():
    rule = render(ENABLED)
    recorded = {r["record"] for r in rules(rule) if "record" in r}
    known = registered() | recorded | {"up"}
    for r in rules(rule):
        names = metric_names(r["expr"])
        assert names, r["expr"]
        assert names <= known, (r.get("alert") or r.get("record"), names - known)


# ---------------------------------------------------------------------------------------------
# promtool


@pytest.mark.parametrize("values", [ENABLED, CUSTOM], ids=["defaults", "custom"])
def test_promtool_checks_the_rules(values, tmp_path):
    write_groups(render(values), tmp_path / "rules.yaml")
    proc = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules(render(values)))} rules found" in proc.stdout


def test_each_alert_fires_and_stays_quiet_when_it_should(tmp_path):
    """promtool compares annotations word for word: the behaviour is tested without them, and
    their templates are checked by `promtool check rules` above."""
    write_groups(render(ENABLED), tmp_path / "rules.yaml", annotations=False)
    shutil.copy(TESTS, tmp_path / TESTS.name)
    proc = promtool("test", "rules", TESTS.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_the_promtool_tests_cover_every_alert_both_ways():
    cases = yaml.safe_load(TESTS.read_text())
    assert cases["rule_files"] == ["rules.yaml"]
    fires, quiet = set(), set()
    for test in cases["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else quiet).add(case["alertname"])
    every = set(alerts(render(ENABLED)))
    assert fires == every and quiet == every


def test_the_values_file_of_the_docs_renders_every_alert(tmp_path):
    docs = (CHART.parents[1] / "docs" / "operations.md").read_text()
    section = docs.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    (values,) = re.findall(r"```yaml\n# alerts.yaml\n(.*?)```", section, re.S)
    (tmp_path / "alerts.yaml").write_text(values)
    out = helm("template", "kvfleet", str(CHART), "--namespace", NAMESPACE,
               "--values", str(tmp_path / "alerts.yaml"))  # fmt: skip
    kinds = [d["kind"] for d in yaml.safe_load_all(out) if d]
    assert kinds.count("PrometheusRule") == 1 and "PodMonitor" in kinds
    documented = set(re.findall(r"^\| `(Kvfleet\w+)` \|", section, re.M))
    assert documented == set(alerts(render(ENABLED)))
