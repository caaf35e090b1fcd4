"""The Helm chart (charts/kvfleet), rendered by the real helm binary.

Every manifest of several value sets is validated offline against Kubernetes' own schemas
(kubernetes-validate, strict) for more than one Kubernetes version; the ClusterRole must equal
operator/rbac.py's OPERATOR_RULES, the chart's CRD must equal crds/ byte for byte, and the
operator's command line must parse with the operator's own parser.

helm comes from `make tools` (.tools/bin/helm), $HELM or PATH. Without it these tests skip
locally and fail under CI=true or KVFLEET_REQUIRE_TOOLS=1 (what `make test` sets).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import socket
import subprocess
import sys
from typing import Any

import jsonschema
import kubernetes_validate
import prometheus_client
import pytest
import yaml

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.main import build_parser, build_registry, build_settings
from kvfleet.operator.rbac import NAMESPACED_OPERATOR_RULES, OPERATOR_RULES, as_manifest
from kvfleet.operator.resources import (
    Owner,
    common_labels,
    engine_deployment,
    engine_service,
    router_deployment,
    router_service,
)
from kvfleet.operator.spec import parse_spec
from kvfleet.telemetry.ports import ENGINE_PORT
from tests.support.kmock import CONFIG as KMOCK_CONFIG
from tests.support.kmock import eventually, kube_for, run_operator
from tests.support.net import free_port
from tests.support.promql import validate_prometheus_rule
from tests.support.tools import CHART, ROOT, helm, run_helm, set_args

# The oldest the chart supports (Chart.yaml kubeVersion), a middle one, and the newest helm knows.
KUBE_VERSIONS = ("1.29", "1.32", "1.35")
NAMESPACE = "kvfleet-system"

NON_DEFAULT = [
    "replicaCount=3",
    "watchNamespaces={team-a,team-b}",
    "logLevel=DEBUG",
    "image.repository=registry.example.com/kvfleet/operator",
    "image.tag=0.1.0-rc1",
    "engine.image.repository=registry.example.com/kvfleet/engine",
    "engine.image.tag=0.1.0-cu128",
    "engine.image.cpuTag=0.1.0-cpu-avx512",
    "router.image.tag=0.1.0-router",
    "monitoring.engines.enabled=true",
    "monitoring.router.enabled=true",
    "monitoring.labels.release=prometheus",
    "networkPolicy.enabled=true",
    "grafana.dashboard.enabled=true",
    "grafana.dashboard.namespace=monitoring",
    "grafana.dashboard.annotations.grafana_folder=LLM",
    "prometheusRule.enabled=true",
    "prometheusRule.labels.release=prometheus",
    "prometheusRule.alertLabels.team=ml",
    "serviceAccount.name=kvfleet-sa",
    "podAnnotations.example\\.com/team=ml",
    "nodeSelector.kubernetes\\.io/os=linux",
    "priorityClassName=system-cluster-critical",
    "allowList.images={registry.example.com/ml/,ghcr.io/kvfleet/engine}",
    "allowList.secrets={hf-token,api-keys}",
]
SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "non-default": NON_DEFAULT,
    "nothing-allowed": ["allowList.images={}", "allowList.secrets={}"],
    "service-monitors": [
        "monitoring.kind=ServiceMonitor",
        "monitoring.engines.enabled=true",
        "monitoring.router.enabled=true",
        "monitoring.operator.enabled=true",
        "prometheusRule.enabled=true",
        "replicaCount=2",
        "networkPolicy.enabled=true",
    ],
}


@functools.cache
def _render(scenario: str, kube_version: str) -> tuple[dict[str, Any], ...]:
    out = helm(
        "template", "kvfleet", str(CHART), "--namespace", NAMESPACE, "--include-crds",
        "--kube-version", kube_version, *set_args(SCENARIOS[scenario]),
    )  # fmt: skip
    return tuple(d for d in yaml.safe_load_all(out) if d)


def render(scenario: str = "default", kube_version: str = KUBE_VERSIONS[-1]) -> list[dict]:
    return list(_render(scenario, kube_version))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, (kind, [d["metadata"]["name"] for d in found])
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    deployment = one(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def operator_args(docs: list[dict]):
    container = operator_container(docs)
    assert container["command"] == ["kvfleet-operator"]
    return build_parser().parse_args(container["args"])


# ---------------------------------------------------------------------------------------------
# lint and offline validation


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_helm_lint_strict(scenario: str):
    out = helm("lint", "--strict", str(CHART), *set_args(SCENARIOS[scenario]))
    assert "0 chart(s) failed" in out


def _custom_resource_schema(crd: dict, version: str) -> dict:
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return v["schema"]["openAPIV3Schema"]


def _validate_monitor(doc: dict) -> None:
    """Prometheus Operator kinds are not in Kubernetes' schemas: check the fields we use."""
    spec = doc["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "podMetricsEndpoints" if
                         doc["kind"] == "PodMonitor" else "endpoints"}  # fmt: skip
    assert set(spec["namespaceSelector"]) <= {"any", "matchNames"}
    assert set(spec["selector"]) == {"matchLabels"}
    for endpoint in spec.get("podMetricsEndpoints", spec.get("endpoints")):
        assert set(endpoint) == {"port", "path", "interval"}
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_manifest_validates(scenario: str, kube_version: str):
    docs = render(scenario, kube_version)
    crds = {d["spec"]["names"]["kind"]: d for d in by_kind(docs, "CustomResourceDefinition")}
    kinds = set()
    for doc in docs:
        kinds.add(doc["kind"])
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else ""
        if group == "kopf.dev":
            # The chart's own CRD is the schema of its peering objects.
            crd = crds[doc["kind"]]
            jsonschema.validate(doc, _custom_resource_schema(crd, doc["apiVersion"].split("/")[1]))
            assert (crd["spec"]["scope"] == "Namespaced") == ("namespace" in doc["metadata"])
        elif doc["kind"] == "PrometheusRule":
            validate_prometheus_rule(doc)
        elif group == "monitoring.coreos.com":
            _validate_monitor(doc)
        else:
            kubernetes_validate.validate(doc, kube_version, strict=True)
    role = "Role" if "watchNamespaces={team-a,team-b}" in SCENARIOS[scenario] else "ClusterRole"
    assert {"CustomResourceDefinition", "ServiceAccount", role, "Deployment"} <= kinds


# ---------------------------------------------------------------------------------------------
# one source of truth: CRDs and RBAC


def test_chart_crds_equal_crds_dir_byte_for_byte():
    """crds/ is the source of truth; Helm installs charts/kvfleet/crds/, a copy.

    Helm packages cannot carry symlinks, hence the copy: after editing crds/, run
    `cp crds/*.yaml charts/kvfleet/crds/`.
    """
    sources = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert sources
    chart_crds = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert chart_crds == sorted([*sources, "kopf-peerings.yaml"])
    for name in sources:
        ours, theirs = (ROOT / "crds" / name).read_bytes(), (CHART / "crds" / name).read_bytes()
        assert ours == theirs, f"charts/kvfleet/crds/{name} drifted: cp crds/{name} {CHART}/crds/"


def test_kopf_peering_crds_match_kopf():
    """The peering resources kopf documents (docs/peering.rst: kopf.dev/v1 ClusterKopfPeering and
    KopfPeering), within the kopf range pyproject.toml allows."""
    crds = yaml.safe_load_all((CHART / "crds" / "kopf-peerings.yaml").read_text())
    got = {
        (c["spec"]["group"], v["name"], c["spec"]["names"]["plural"], c["spec"]["scope"])
        for c in crds
        for v in c["spec"]["versions"]
        if v["served"] and v["storage"]
    }
    want = {
        ("kopf.dev", "v1", "clusterkopfpeerings", "Cluster"),
        ("kopf.dev", "v1", "kopfpeerings", "Namespaced"),
    }
    assert got == want


@pytest.mark.parametrize("scenario", ["default", "service-monitors"])
def test_cluster_role_is_exactly_operator_rules(scenario: str):
    docs = render(scenario)
    role = one(docs, "ClusterRole")
    assert role["rules"] == as_manifest(OPERATOR_RULES), "regenerate: kvfleet-operator print-rbac"
    assert not by_kind(docs, "Role")
    for doc in docs:
        for rule in doc.get("rules", []):
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        ref = doc.get("roleRef")
        if ref:
            assert ref == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role["metadata"]["name"],
            }


def test_namespaced_mode_grants_roles_in_the_watched_namespaces_only():
    """watchNamespaces: a Role (rbac.NAMESPACED_OPERATOR_RULES) and a RoleBinding in each watched
    namespace; no ClusterRole, no ClusterRoleBinding, nothing cluster-scoped but the CRDs."""
    docs = render("non-default")
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                      "ClusterKopfPeering"}  # fmt: skip
    assert [d["kind"] for d in docs if d["kind"] in cluster_scoped] == [
        "CustomResourceDefinition"
    ] * len(by_kind(docs, "CustomResourceDefinition"))
    roles = {r["metadata"]["namespace"]: r for r in by_kind(docs, "Role")}
    assert sorted(roles) == ["team-a", "team-b"]
    for role in roles.values():
        assert role["rules"] == as_manifest(NAMESPACED_OPERATOR_RULES)
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert "clusterkopfpeerings" not in rule["resources"]
    for binding in by_kind(docs, "RoleBinding"):
        role = roles[binding["metadata"]["namespace"]]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
    # The operator serves exactly those namespaces: what it watches is what it may read.
    assert operator_args(docs).namespace == ("team-a", "team-b")


def test_print_rbac_prints_what_the_chart_grants(capsys):
    from kvfleet.operator.main import main

    assert main(["print-rbac", "-n", "team-a,team-b", "--service-account", f"{NAMESPACE}/sa"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["namespace"]) for d in printed] == [
        (kind, ns) for ns in ("team-a", "team-b") for kind in ("Role", "RoleBinding")
    ]
    chart_roles = by_kind(render("non-default"), "Role")
    assert all(d["rules"] == chart_roles[0]["rules"] for d in printed if d["kind"] == "Role")


def test_bindings_cluster_wide_by_default():
    docs = render("default")
    binding = one(docs, "ClusterRoleBinding")
    sa = one(docs, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert not by_kind(docs, "RoleBinding")
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_bindings_per_namespace_when_namespaces_are_listed():
    docs = render("non-default")
    assert not by_kind(docs, "ClusterRoleBinding")
    assert one(docs, "ServiceAccount")["metadata"]["name"] == "kvfleet-sa"
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "kvfleet-sa", "namespace": NAMESPACE}
        ]


# ---------------------------------------------------------------------------------------------
# the operator Deployment


def test_default_operator_command_line_and_images():
    docs = render("default")
    ns = operator_args(docs)
    defaults = OperatorConfig()
    assert ns.command == "run"
    # No allow-lists unless asked for: any image, any Secret (docs/operations.md says so).
    assert ns.allowed_images is None and ns.allowed_secrets is None
    assert ns.namespace == () and ns.peering is None and ns.log_level == "INFO"
    # The chart's appVersion tags are the operator's built-in defaults.
    assert ns.engine_image == defaults.engine_image
    assert ns.engine_cpu_image == defaults.engine_cpu_image
    assert ns.router_image == defaults.router_image
    assert operator_container(docs)["image"] == defaults.router_image
    assert one(docs, "Deployment")["spec"]["replicas"] == 1
    assert not by_kind(docs, "ClusterKopfPeering") and not by_kind(docs, "KopfPeering")


def test_chart_app_version_is_the_package_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version and chart["appVersion"] == version.group(1)


def test_non_default_operator_command_line():
    docs = render("non-default")
    ns = operator_args(docs)
    assert ns.log_level == "DEBUG"
    assert ns.namespace == ("team-a", "team-b")
    assert ns.engine_image == "registry.example.com/kvfleet/engine:0.1.0-cu128"
    assert ns.engine_cpu_image == "registry.example.com/kvfleet/engine:0.1.0-cpu-avx512"
    assert ns.router_image == "registry.example.com/kvfleet/operator:0.1.0-router"
    assert ns.allowed_images == ("registry.example.com/ml/", "ghcr.io/kvfleet/engine")
    assert ns.allowed_secrets == ("hf-token", "api-keys")
    assert operator_container(docs)["image"] == "registry.example.com/kvfleet/operator:0.1.0-rc1"
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"example.com/team": "ml"}
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_empty_allow_lists_allow_nothing():
    ns = operator_args(render("nothing-allowed"))
    assert ns.allowed_images == () and ns.allowed_secrets == ()


def test_several_replicas_use_kopf_peering_cluster_wide():
    docs = render("service-monitors")
    assert one(docs, "Deployment")["spec"]["replicas"] == 2
    peering = one(docs, "ClusterKopfPeering")
    assert operator_args(docs).peering == peering["metadata"]["name"] == "kvfleet"


def test_several_replicas_use_kopf_peering_per_namespace():
    docs = render("non-default")
    peerings = by_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {operator_args(docs).peering}
    assert not by_kind(docs, "ClusterKopfPeering")


def test_operator_pod_is_restricted_and_probed_where_it_listens():
    docs = render("default")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    port = int(operator_args(docs).health_address.rsplit(":", 1)[1])
    metrics = int(operator_args(docs).metrics_address.rsplit(":", 1)[1])
    assert container["ports"] == [
        {"name": "health", "containerPort": port, "protocol": "TCP"},
        {"name": "metrics", "containerPort": metrics, "protocol": "TCP"},
    ]
    # kopf serves liveness at the path of liveness_endpoint (operator/main.py).
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


# ---------------------------------------------------------------------------------------------
# monitors and network policies select what the operator creates


def _children() -> dict[str, dict]:
    spec = parse_spec("llm", {"resources": {"gpus": 0}})
    owner = Owner(name="llm", namespace="team-a", uid="u")
    config = OperatorConfig()
    return {
        "engine-pod": engine_deployment(owner, spec, config)["spec"]["template"],
        "router-pod": router_deployment(owner, spec, config)["spec"]["template"],
        "engine-svc": engine_service(owner),
        "router-svc": router_service(owner),
    }


@pytest.mark.parametrize("scenario", ["non-default", "service-monitors"])
def test_monitors_select_engine_and_router_metrics_ports(scenario: str):
    docs = render(scenario)
    kind = "ServiceMonitor" if scenario == "service-monitors" else "PodMonitor"
    monitors = [m for m in by_kind(docs, kind) if not m["metadata"]["name"].endswith("-operator")]
    assert len(monitors) == 2
    children = _children()
    for monitor in monitors:
        component = monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert component in ("engine", "router")
        if kind == "PodMonitor":
            target = children[f"{component}-pod"]
            ports = {p["name"] for c in target["spec"]["containers"] for p in c["ports"]}
            endpoints = monitor["spec"]["podMetricsEndpoints"]
        else:
            target = children[f"{component}-svc"]
            ports = {p["name"] for p in target["spec"]["ports"]}
            endpoints = monitor["spec"]["endpoints"]
        labels = target["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert {e["port"] for e in endpoints} <= ports
    if scenario == "non-default":
        assert monitors[0]["metadata"]["labels"]["release"] == "prometheus"
        assert monitors[0]["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    else:
        assert monitors[0]["spec"]["namespaceSelector"] == {"any": True}


def test_no_monitors_or_network_policies_by_default():
    kinds = {d["kind"] for d in render("default")}
    assert not kinds & {
        "PodMonitor",
        "ServiceMonitor",
        "NetworkPolicy",
        "ConfigMap",
        "PrometheusRule",
    }


def test_the_grafana_dashboard_is_a_configmap_for_the_sidecar():
    (dashboard,) = by_kind(render("non-default"), "ConfigMap")
    meta = dashboard["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["namespace"] == "monitoring" and meta["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART / "dashboards" / "kvfleet.json").read_text())
    assert json.loads(dashboard["data"]["kvfleet.json"]) == shipped


def test_network_policies_admit_what_the_operator_needs():
    docs = render("non-default")
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in
                by_kind(docs, "NetworkPolicy")}  # fmt: skip
    assert set(policies) == {
        (NAMESPACE, "kvfleet-operator"),
        ("team-a", "kvfleet-engines"),
        ("team-b", "kvfleet-engines"),
    }
    operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    engine_labels = _children()["engine-pod"]["metadata"]["labels"]
    router_labels = _children()["router-pod"]["metadata"]["labels"]
    op = policies[(NAMESPACE, "kvfleet-operator")]["spec"]
    assert op["podSelector"]["matchLabels"].items() <= operator_labels.items()
    to_engines = [e for e in op["egress"] if any("podSelector" in t for t in e.get("to", []))]
    (rule,) = to_engines
    assert rule["to"][0]["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert rule["ports"] == [{"port": ENGINE_PORT, "protocol": "TCP"}]
    eng = policies[("team-a", "kvfleet-engines")]["spec"]
    assert eng["podSelector"]["matchLabels"].items() <= engine_labels.items()
    (ingress,) = eng["ingress"]
    assert ingress["ports"] == [{"port": ENGINE_PORT, "protocol": "TCP"}]
    routers, operator = ingress["from"]
    assert routers["podSelector"]["matchLabels"].items() <= router_labels.items()
    assert operator["podSelector"]["matchLabels"].items() <= operator_labels.items()
    assert operator["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": NAMESPACE
    }


def test_labels_the_chart_selects_are_the_operators():
    # resources.py's labels are what the monitors and policies above rely on.
    assert common_labels("x", "engine")["app.kubernetes.io/managed-by"] == "kvfleet-operator"


# ---------------------------------------------------------------------------------------------
# values and NOTES


VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """The leaf values of values.yaml by path (".image.tag"); an empty map is a leaf."""
    if isinstance(node, dict) and node:
        return {p: x for k, v in node.items() for p, x in leaves(v, f"{prefix}.{k}").items()}
    return {prefix: node}


def test_every_value_is_used_by_a_template():
    templates = "".join(p.read_text() for p in (CHART / "templates").rglob("*.*"))
    # Read through a variable (index $.Values.monitoring $component): counted by name.
    dynamic = {".monitoring.engines.enabled", ".monitoring.router.enabled"}
    for path in leaves(VALUES):
        if path in dynamic:
            continue
        # The value itself, or an enclosing object used whole (toYaml .Values.resources).
        parts = path.split(".")[1:]
        used = any(
            re.search(re.escape(".Values." + ".".join(parts[:n])) + r"(?![\w.])", templates)
            for n in range(len(parts), 0, -1)
            if ".".join(parts[:n]) != "monitoring"
        )
        assert used, f"values.yaml{path} is never used"


def test_notes_say_what_to_apply_next():
    out = helm("install", "kvfleet", str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    notes = out.split("NOTES:", 1)[1]
    assert "examples/inferenceservice-cpu-demo.yaml" in notes
    assert "kubectl get kvis tiny-demo" in notes
    assert "kubectl port-forward svc/tiny-demo" in notes
    assert "smollm2-135m-instruct" in notes
    assert (ROOT / "examples" / "inferenceservice-cpu-demo.yaml").is_file()
    demo = yaml.safe_load((ROOT / "examples" / "inferenceservice-cpu-demo.yaml").read_text())
    assert demo["metadata"]["name"] == "tiny-demo"


def test_the_operator_serves_its_metrics_and_a_monitor_scrapes_them():
    """kvfleet_operator_* (scrape and autoscaling failures) on --metrics-address, the port the
    pod declares, scraped by a PodMonitor (the operator has no Service) that selects the pod."""
    docs = render("service-monitors")
    (deploy,) = by_kind(docs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--metrics-address=0.0.0.0:{ports['metrics']}" in container["args"]
    (monitor,) = [
        m for m in by_kind(docs, "PodMonitor") if m["metadata"]["name"].endswith("-operator")
    ]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert not [m for m in by_kind(render("default"), "PodMonitor")]


# ---------------------------------------------------------------------------------------------
# values.schema.json and the chart README: every value typed, checked and documented

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
README = (CHART / "README.md").read_text()


def schema_node(path: str) -> dict[str, Any] | None:
    """The schema of a values path (".image.tag"), $refs followed; None inside a free-form object
    (podSecurityContext.runAsUser: the API server checks those)."""
    node: dict[str, Any] = SCHEMA
    for key in path.split(".")[1:]:
        if key in node.get("properties", {}):
            node = node["properties"][key]
        else:
            assert node.get("additionalProperties") is not False, f"{path}: not in the schema"
            return None
        while "$ref" in node:
            node = SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def readme_rows() -> dict[str, tuple[str, Any]]:
    """The README's values table: path -> (type, default parsed as YAML)."""
    rows = re.findall(r"^\| `([\w.]+)` \| ([\w ]+) \| `([^`]*)` \|", README, re.M)
    return {f".{key}": (kind, yaml.safe_load(default)) for key, kind, default in rows}


# README type -> (JSON Schema type, Python type of the YAML value)
README_TYPES: dict[str, tuple[str, Any]] = {
    "string": ("string", str), "integer": ("integer", int), "boolean": ("boolean", bool),
    "list": ("array", list), "map": ("object", dict), "list or null": ("array,null", list | None),
    "number": ("number", int | float),
}  # fmt: skip


def test_values_yaml_meets_its_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator(SCHEMA).validate(VALUES)
    # Typos are refused at every level a user types keys into, but free-form Kubernetes objects.
    assert SCHEMA["additionalProperties"] is False
    for path in leaves(VALUES):
        schema_node(path)


def test_readme_lists_every_value_with_its_type_and_default():
    rows = readme_rows()
    values = leaves(VALUES)
    assert sorted(rows) == sorted(values), "charts/kvfleet/README.md's table drifted"
    for path, (kind, default) in rows.items():
        assert default == values[path], path
        schema_type, python_type = README_TYPES[kind]
        assert isinstance(default, python_type), path
        node = schema_node(path)
        if node is not None:
            declared = node["type"]
            assert schema_type == (",".join(declared) if isinstance(declared, list) else declared)


# (value set, the path helm names, words of its message)
BAD_VALUES = [
    ("logLevel=verbose", "/logLevel", "must be one of"),
    ("replicaCount=-1", "/replicaCount", "minimum"),
    ("replicas=2", "''", "additional properties 'replicas' not allowed"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy", "must be one of"),
    ("healthPort=70000", "/healthPort", "maximum"),
    ("metricsPort=http", "/metricsPort", "want integer"),
    ("watchNamespaces={Team_A}", "/watchNamespaces/0", "does not match pattern"),
    ("monitoring.kind=Probe", "/monitoring/kind", "must be one of"),
    ("monitoring.interval=fast", "/monitoring/interval", "does not match pattern"),
    ("monitoring.engines.enable=true", "/monitoring/engines", "'enable' not allowed"),
    ("networkPolicy.apiServer.cidr=10.0.0.1", "/networkPolicy/apiServer/cidr", "pattern"),
    ("allowList.images={registry.example.com/a b}", "/allowList/images/0", "pattern"),
    ("serviceAccount.create=yes", "/serviceAccount/create", "want boolean"),
    ("grafana.dashboard.namespace=Monitoring", "/grafana/dashboard/namespace", "pattern"),
    ("prometheusRule.sustainedFor=soon", "/prometheusRule/sustainedFor", "pattern"),
    ("prometheusRule.sustainedFor=30s15m", "/prometheusRule/sustainedFor", "pattern"),
    (
        "prometheusRule.ttftSLO.thresholdSeconds=3",
        "/prometheusRule/ttftSLO/thresholdSeconds",
        "one of",
    ),
    ("prometheusRule.alertLabels.team-name=ml", "/prometheusRule/alertLabels", "'team-name' not"),
]


@pytest.mark.parametrize(("value", "path", "words"), BAD_VALUES, ids=[v[0] for v in BAD_VALUES])
def test_a_bad_value_is_refused_with_its_path(value: str, path: str, words: str):
    for command in (
        ["lint", "--strict", str(CHART)],
        ["template", "kvfleet", str(CHART)],
        ["install", "kvfleet", str(CHART), "--dry-run=client", "--namespace", NAMESPACE],
    ):
        proc = run_helm(*command, "--set", value)
        assert proc.returncode != 0, (command, value)
        out = proc.stdout + proc.stderr
        assert f"at '{path.strip(chr(39))}'" in out and words in out, out


def test_one_port_for_health_and_metrics_is_refused():
    proc = run_helm("template", "kvfleet", str(CHART), "--set", "metricsPort=8081")
    assert proc.returncode != 0 and "healthPort and metricsPort must differ" in proc.stderr


def test_the_chart_can_be_a_dependency():
    """Helm passes `global` to a subchart: the schema must not refuse it."""
    helm("template", "kvfleet", str(CHART), "--set", "global.imageRegistry=registry.example.com")


# ---------------------------------------------------------------------------------------------
# helm test


def hook_pod(docs: list[dict]) -> dict:
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    return pod


@pytest.mark.parametrize("scenario", ["default", "non-default"])
def test_helm_test_pod_checks_the_operator_through_its_service(scenario: str):
    docs = render(scenario)
    pod = hook_pod(docs)
    (service,) = by_kind(docs, "Service")
    operator_pod = one(docs, "Deployment")["spec"]["template"]
    selector = service["spec"]["selector"]
    assert selector.items() <= operator_pod["metadata"]["labels"].items()
    assert not selector.items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in operator_container(docs)["ports"]}
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    for name, path in (("health", "healthz"), ("metrics", "metrics")):
        assert ports[name]["targetPort"] == name and name in container_ports
        assert env[f"{name.upper()}_URL"] == f"http://{host}:{ports[name]['port']}/{path}"
    # The operator's image, hardened as the operator is, with no API credentials.
    assert container["image"] == operator_container(docs)["image"]
    assert container["securityContext"] == operator_container(docs)["securityContext"]
    assert pod["spec"]["securityContext"] == operator_pod["spec"]["securityContext"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["restartPolicy"] == "Never"


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def _run_hook_script(pod: dict, health_url: str, metrics_url: str) -> subprocess.CompletedProcess:
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["python", "-c"]
    env = {**os.environ, "HEALTH_URL": health_url, "METRICS_URL": metrics_url}
    return subprocess.run(
        [sys.executable, "-c", container["command"][2]],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.asyncio
async def test_helm_test_script_passes_on_a_running_operator_only(cluster):
    """The hook's own script, against kopf's /healthz of an operator on kmock and the operator's
    metrics server as main.py starts it; a port that does not answer fails it in one line."""
    pod = hook_pod(render("default"))
    health = f"http://127.0.0.1:{free_port()}/healthz"
    metrics_port = free_port()
    server, thread = prometheus_client.start_http_server(metrics_port, "127.0.0.1")
    try:
        settings = build_settings()
        registry = build_registry(settings, KMOCK_CONFIG, kube=kube_for(cluster))
        metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        async with run_operator(registry, settings, liveness_endpoint=health):
            # As `helm install --wait` does before `helm test`: the operator is up first (kopf
            # opens its liveness endpoint a moment after the operator starts).
            port = int(health.split(":")[2].split("/")[0])
            await eventually(functools.partial(_listening, port), timeout=30)
            ok = await asyncio.to_thread(_run_hook_script, pod, health, metrics)
            assert ok.returncode == 0, ok.stderr
            dead = f"http://127.0.0.1:{free_port()}/healthz"
            failed = await asyncio.to_thread(_run_hook_script, pod, dead, metrics)
        assert failed.returncode == 1
        assert failed.stderr.startswith(f"FAILED: {dead}: ") and failed.stderr.count("\n") == 1
    finally:
        server.shutdown()
        thread.join(5)
