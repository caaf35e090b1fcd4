"""The GitOps examples (examples/gitops): the Argo CD health check, run by a real Lua interpreter
(lupa) on statuses the operator's own status code computes, and the Argo CD and Flux manifests,
validated offline.

No Argo CD or Flux CRD is installed here, so their objects are checked against minimal schemas
written from the fields their documentation gives (unknown keys refused where a typo would be
silently ignored by the real controller), the Kubernetes objects against Kubernetes' own schemas,
the InferenceService against the CRD and the operator's parser, and every chart value they set
against charts/kvfleet/values.yaml.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import lupa
import pytest
import yaml

from kvfleet.operator.spec import parse_spec
from kvfleet.operator.status import Observed, Problem, compute_status

ROOT = Path(__file__).resolve().parents[1]
GITOPS = ROOT / "examples" / "gitops"
HEALTH_LUA = GITOPS / "argocd" / "health-inferenceservice.lua"
HEALTH_KEY = "resource.customizations.health.kvfleet.dev_InferenceService"
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
CRD_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CHART = yaml.safe_load((ROOT / "charts" / "kvfleet" / "Chart.yaml").read_text())
VALUES = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
VALUES_SCHEMA = json.loads((ROOT / "charts" / "kvfleet" / "values.schema.json").read_text())
CHART_OCI = "ghcr.io/kvfleet/charts"
KUBE_VERSION = "1.30"
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
# What Argo CD's Lua VM (gopher-lua) offers a health script; anything else is absent there.
LUA_GLOBALS = ("ipairs", "pairs", "tostring", "tonumber", "type", "next", "string", "table", "math")


def docs(*parts: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(GITOPS.joinpath(*parts).read_text()) if d]


def one(documents: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in documents if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


# --- the health check --------------------------------------------------------------------------


def _to_lua(lua: lupa.LuaRuntime, value: Any) -> Any:
    # Argo CD hands the object to Lua as nested tables, lists 1-indexed.
    if isinstance(value, Mapping):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: Mapping[str, Any]) -> tuple[str, str]:
    lua = lupa.LuaRuntime()
    env = lua.table_from({name: lua.globals()[name] for name in LUA_GLOBALS})
    env["obj"] = _to_lua(lua, obj)
    script = lua.globals().load(HEALTH_LUA.read_text(), "health", "t", env)
    hs = script()
    assert hs["status"] in ("Healthy", "Progressing", "Degraded", "Suspended")
    assert isinstance(hs["message"], str)
    return hs["status"], hs["message"]


def deployment(want: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    """A live Deployment as the Deployment controller reports it; a rollout while updated is
    below want."""
    updated = want if updated is None else updated
    conditions = (
        [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]
        if updated == want
        else [{"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}]
    )
    return {
        "metadata": {"generation": 2},
        "spec": {"replicas": want},
        "status": {
            "observedGeneration": 2,
            "replicas": max(want, ready),
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": conditions,
        },
    }


def crash_looping_pod() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "chat-engine-7d4-x2",
            "labels": {"app.kubernetes.io/component": "engine"},
        },
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}},
                }
            ]
        },
    }


def inference_service(generation: int = 1, **observed: Any) -> dict[str, Any]:
    """The example InferenceService with the status the operator computes from `observed` (for
    `observed_generation`, default `generation`); no status at all without `observed`."""
    obj = copy.deepcopy(one(docs("inferenceservices", "chat.yaml"), "InferenceService"))
    obj["metadata"]["generation"] = generation
    if observed:
        seen = observed.pop("observed_generation", generation)
        status = compute_status(
            Observed(generation=seen, selector="sel", previous={}, **observed), NOW
        )
        obj["status"] = {k: v for k, v in status.items() if v is not None}
    return obj


SERVING = {"engine": deployment(1, 1), "router": deployment(1, 1), "url": "http://chat.llm.svc/v1"}


def test_serving_is_healthy():
    assert health(inference_service(**SERVING)) == (
        "Healthy",
        "Serving: 1 of 1 engine and 1 of 1 router replicas ready",
    )


def test_rollout_is_progressing_even_while_serving():
    status, message = health(
        inference_service(engine=deployment(2, 1, updated=1), router=deployment(1, 1))
    )
    assert (status, message) == ("Progressing", "RollingOut: engine: 1 of 2 replicas updated")


@pytest.mark.parametrize(
    ("observed", "message"),
    [
        ({"engine": None}, "RollingOut: engine: not created yet; router: not created yet"),
        ({"engine": deployment(1, 0), "router": deployment(1, 1)}, "EngineNotReady: 0 of 1 engine"),
    ],
)
def test_not_yet_serving_is_progressing(observed: dict[str, Any], message: str):
    status, text = health(inference_service(**observed))
    assert status == "Progressing" and text.startswith(message)


def test_crash_loop_is_degraded_with_the_operators_message():
    status, message = health(
        inference_service(
            engine=deployment(1, 0), router=deployment(1, 1), pods=[crash_looping_pod()]
        )
    )
    assert status == "Degraded"
    assert message == (
        "CrashLoopBackOff: engine pod chat-engine-7d4-x2: container engine is crash-looping "
        "(last exit code 1 (Error))"
    )


def test_a_refused_spec_is_degraded_although_the_old_children_still_serve():
    obj = inference_service(
        **SERVING, refused=[Problem("ImageNotAllowed", "engine.image evil.io/x is not allowed")]
    )
    assert {c["type"]: c["status"] for c in obj["status"]["conditions"]}["Ready"] == "True"
    assert health(obj) == ("Degraded", "ImageNotAllowed: engine.image evil.io/x is not allowed")


def test_an_invalid_spec_is_degraded():
    status, message = health(inference_service(**SERVING, spec_error="maxReplicas: must be >= 1"))
    assert (status, message) == ("Degraded", "InvalidSpec: maxReplicas: must be >= 1")


def test_scaled_to_zero_is_healthy():
    obj = inference_service(engine=deployment(0, 0), router=deployment(1, 1))
    assert health(obj) == ("Healthy", "ScaledToZero: no engine replicas are running")


def test_a_status_of_an_older_generation_is_progressing_whatever_it_says():
    # A sync just changed the spec (generation 5); the status still describes generation 4.
    obj = inference_service(generation=5, observed_generation=4, **SERVING)
    assert health(obj) == (
        "Progressing",
        "Waiting for the kvfleet operator to observe generation 5",
    )
    # The conditions' own observedGeneration counts too, where the top-level one is current.
    obj["status"]["observedGeneration"] = 5
    assert health(obj)[0] == "Progressing"
    degraded = inference_service(generation=5, observed_generation=4, **SERVING, spec_error="x")
    assert health(degraded)[0] == "Progressing"


def test_no_status_is_progressing():
    assert health(inference_service()) == (
        "Progressing",
        "Waiting for the kvfleet operator to report a status",
    )
    obj = inference_service()
    obj["status"] = {"observedGeneration": 1}
    assert health(obj)[0] == "Progressing"


def test_argocd_cm_installs_the_health_check_verbatim():
    cm = one(docs("argocd", "argocd-cm.yaml"), "ConfigMap", "argocd-cm")
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)
    assert cm["metadata"]["namespace"] == "argocd"
    assert cm["data"][HEALTH_KEY] == HEALTH_LUA.read_text()
    # Children carry app.kubernetes.io/instance=<service>: label tracking would claim them.
    assert cm["data"]["application.resourceTrackingMethod"] == "annotation"


# --- the Argo CD and Flux objects --------------------------------------------------------------


def _obj(properties: dict[str, Any], required: list[str], closed: bool = True) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": not closed,
    }


STR = {"type": "string", "minLength": 1}
BOOL = {"type": "boolean"}
DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"}
META = _obj({"name": STR, "namespace": STR}, ["name", "namespace"], closed=False)
LOCAL_REF = _obj({"name": STR}, ["name"])


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": META,
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


# argoproj.io/v1alpha1 Application: the fields of Argo CD's declarative-setup documentation used
# here; a helm source needs a chart, a git source a path.
ARGO_SOURCE = {
    "oneOf": [
        _obj(
            {
                "repoURL": STR,
                "chart": STR,
                "targetRevision": STR,
                "helm": _obj(
                    {"releaseName": STR, "valuesObject": {"type": "object"}, "values": STR}, []
                ),
            },
            ["repoURL", "chart", "targetRevision"],
        ),
        _obj({"repoURL": STR, "path": STR, "targetRevision": STR}, ["repoURL", "path"]),
    ]
}
SYNC_OPTION = {
    "enum": [
        "CreateNamespace=true",
        "ServerSideApply=true",
        "RespectIgnoreDifferences=true",
        "PruneLast=true",
        "ApplyOutOfSyncOnly=true",
        "SkipDryRunOnMissingResource=true",
    ]
}
APPLICATION = _resource(
    "argoproj.io/v1alpha1",
    "Application",
    _obj(
        {
            "project": STR,
            "source": ARGO_SOURCE,
            "destination": _obj({"server": STR, "namespace": STR}, ["server", "namespace"]),
            "ignoreDifferences": {
                "type": "array",
                "items": _obj(
                    {
                        "group": STR,
                        "kind": STR,
                        "jsonPointers": {"type": "array", "items": {"pattern": "^/"}},
                    },
                    ["kind", "jsonPointers"],
                ),
            },
            "syncPolicy": _obj(
                {
                    "automated": _obj({"prune": BOOL, "selfHeal": BOOL}, []),
                    "syncOptions": {"type": "array", "items": SYNC_OPTION},
                    "retry": _obj(
                        {
                            "limit": {"type": "integer"},
                            "backoff": _obj(
                                {
                                    "duration": DURATION,
                                    "factor": {"type": "integer"},
                                    "maxDuration": DURATION,
                                },
                                [],
                            ),
                        },
                        [],
                    ),
                },
                [],
            ),
        },
        ["project", "source", "destination"],
    ),
)
# source.toolkit.fluxcd.io/v1 OCIRepository, helm.toolkit.fluxcd.io/v2 HelmRelease and
# kustomize.toolkit.fluxcd.io/v1 Kustomization: the fields of Flux's API reference used here.
OCI_REPOSITORY = _resource(
    "source.toolkit.fluxcd.io/v1",
    "OCIRepository",
    _obj(
        {
            "interval": DURATION,
            "url": {"type": "string", "pattern": "^oci://"},
            "ref": _obj({"tag": STR, "semver": STR, "digest": STR}, [], closed=True),
            "layerSelector": _obj(
                {"mediaType": STR, "operation": {"enum": ["extract", "copy"]}}, ["mediaType"]
            ),
        },
        ["interval", "url"],
    ),
)
CRD_POLICY = {"enum": ["Skip", "Create", "CreateReplace"]}
REMEDIATION = _obj({"retries": {"type": "integer"}}, [])
HELM_RELEASE = _resource(
    "helm.toolkit.fluxcd.io/v2",
    "HelmRelease",
    _obj(
        {
            "interval": DURATION,
            "releaseName": STR,
            "chartRef": _obj(
                {"kind": {"enum": ["OCIRepository", "HelmChart"]}, "name": STR}, ["kind", "name"]
            ),
            "install": _obj({"crds": CRD_POLICY, "remediation": REMEDIATION}, []),
            "upgrade": _obj({"crds": CRD_POLICY, "remediation": REMEDIATION}, []),
            "driftDetection": _obj({"mode": {"enum": ["enabled", "warn", "disabled"]}}, ["mode"]),
            "values": {"type": "object"},
        },
        ["interval", "chartRef"],
    ),
)
KUSTOMIZATION = _resource(
    "kustomize.toolkit.fluxcd.io/v1",
    "Kustomization",
    _obj(
        {
            "interval": DURATION,
            "sourceRef": _obj(
                {"kind": {"enum": ["GitRepository", "OCIRepository", "Bucket"]}, "name": STR},
                ["kind", "name"],
            ),
            "path": {"type": "string", "pattern": r"^\./"},
            "prune": BOOL,
            "wait": BOOL,
            "timeout": DURATION,
            "dependsOn": {"type": "array", "items": LOCAL_REF},
        },
        ["interval", "sourceRef", "prune"],
    ),
)
SCHEMAS = {
    "Application": APPLICATION,
    "OCIRepository": OCI_REPOSITORY,
    "HelmRelease": HELM_RELEASE,
    "Kustomization": KUSTOMIZATION,
}
MANIFESTS = [
    ("argocd", "applications.yaml"),
    ("argocd", "argocd-cm.yaml"),
    ("flux", "kvfleet-operator.yaml"),
    ("flux", "kustomizations.yaml"),
    ("inferenceservices", "namespace.yaml"),
    ("inferenceservices", "chat.yaml"),
]


def test_every_manifest_is_tested():
    found = {p.relative_to(GITOPS).parts for p in GITOPS.rglob("*.yaml")}
    assert found == set(MANIFESTS)


@pytest.mark.parametrize("parts", MANIFESTS, ids="/".join)
def test_manifests_validate(parts: tuple[str, str]):
    for doc in docs(*parts):
        if doc["kind"] in SCHEMAS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
        elif doc["kind"] == "InferenceService":
            # OpenAPI v3 schemas keep draft 4's boolean exclusiveMinimum; parse_spec holds the
            # CRD's CEL rules (tests/operator/test_crd_schema.py keeps the two in agreement).
            jsonschema.Draft4Validator(CRD_SCHEMA).validate(doc)
            parse_spec(doc["metadata"]["name"], doc["spec"])
        else:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("bad", ["spec.source.chart", "spec.syncPolicy.automated.prunee"])
def test_the_minimal_schemas_catch_mistakes(bad: str):
    app = copy.deepcopy(one(docs("argocd", "applications.yaml"), "Application", "kvfleet-operator"))
    *path, last = bad.split(".")
    node = app
    for key in path:
        node = node[key]
    if last in node:
        del node[last]
    else:
        node[last] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(app, APPLICATION)


def _unknown_keys(values: Mapping[str, Any], known: Mapping[str, Any], at: str = "") -> list[str]:
    unknown = []
    for key, value in values.items():
        if key not in known:
            unknown.append(f"{at}{key}")
        elif isinstance(value, Mapping) and isinstance(known[key], Mapping):
            unknown += _unknown_keys(value, known[key], f"{at}{key}.")
    return unknown


def _chart_values() -> list[tuple[str, dict[str, Any]]]:
    app = one(docs("argocd", "applications.yaml"), "Application", "kvfleet-operator")
    release = one(docs("flux", "kvfleet-operator.yaml"), "HelmRelease")
    return [
        ("Application kvfleet-operator", app["spec"]["source"]["helm"]["valuesObject"]),
        ("HelmRelease kvfleet", release["spec"]["values"]),
    ]


def _coalesce(defaults: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """The values helm renders with: the user's over the chart's, maps merged key by key."""
    merged = dict(defaults)
    for key, value in values.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _coalesce(merged[key], value)
        else:
            merged[key] = value
    return merged


@pytest.mark.parametrize(("where", "values"), _chart_values(), ids=lambda v: str(v)[:30])
def test_chart_values_they_set_exist(where: str, values: dict[str, Any]):
    assert values, where
    assert _unknown_keys(values, VALUES) == [], where
    jsonschema.Draft7Validator(VALUES_SCHEMA).validate(_coalesce(VALUES, values))


def test_a_misspelt_value_is_caught():
    assert _unknown_keys({"allowList": {"imagez": []}}, VALUES) == ["allowList.imagez"]


def test_both_install_the_chart_the_release_pushes():
    app = one(docs("argocd", "applications.yaml"), "Application", "kvfleet-operator")
    repo = one(docs("argocd", "applications.yaml"), "Secret", "kvfleet-charts")
    assert app["spec"]["source"]["repoURL"] == repo["stringData"]["url"] == CHART_OCI
    assert repo["stringData"]["enableOCI"] == "true"
    assert (app["spec"]["source"]["chart"], app["spec"]["source"]["targetRevision"]) == (
        CHART["name"],
        CHART["version"],
    )
    oci = one(docs("flux", "kvfleet-operator.yaml"), "OCIRepository")
    assert oci["spec"]["url"] == f"oci://{CHART_OCI}/{CHART['name']}"
    major, minor, _ = CHART["version"].split(".")
    assert oci["spec"]["ref"]["semver"] == f"{major}.{minor}.x"
    release = one(docs("flux", "kvfleet-operator.yaml"), "HelmRelease")
    assert release["spec"]["chartRef"] == {"kind": "OCIRepository", "name": oci["metadata"]["name"]}
    assert release["metadata"]["namespace"] == oci["metadata"]["namespace"]
    # The release pushes to oci://ghcr.io/<owner>/charts, the owner of the chart's own images.
    workflow = (ROOT / ".github" / "workflows" / "release.yaml").read_text()
    assert '"oci://ghcr.io/$OWNER/charts"' in workflow
    owner = VALUES["image"]["repository"].removeprefix("ghcr.io/").split("/")[0]
    assert f"ghcr.io/{owner}/charts" == CHART_OCI


def test_flux_deploys_services_after_the_operator_from_the_example_folder():
    kustomizations = {d["metadata"]["name"]: d for d in docs("flux", "kustomizations.yaml")}
    services = kustomizations["inferenceservices"]["spec"]
    assert services["dependsOn"] == [{"name": "kvfleet-operator"}]
    assert kustomizations["kvfleet-operator"]["spec"]["wait"] is True
    # The Argo CD Application for the services reads the same folder layout.
    app = one(docs("argocd", "applications.yaml"), "Application", "kvfleet-inferenceservices")
    assert f"./{app['spec']['source']['path']}" == services["path"]


def test_only_external_mode_needs_an_ignored_difference():
    app = one(docs("argocd", "applications.yaml"), "Application", "kvfleet-inferenceservices")
    assert app["spec"]["ignoreDifferences"] == [
        {"group": "kvfleet.dev", "kind": "InferenceService", "jsonPointers": ["/spec/replicas"]}
    ]
    assert "RespectIgnoreDifferences=true" in app["spec"]["syncPolicy"]["syncOptions"]
    assert (
        CRD["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    )
    # The example itself leaves the count to the builtin autoscaler: nothing to ignore there.
    service = one(docs("inferenceservices", "chat.yaml"), "InferenceService")
    assert service["spec"]["autoscaling"]["mode"] == "builtin" and "replicas" not in service["spec"]
