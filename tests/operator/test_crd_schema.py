"""The InferenceService CRD: a valid structural schema that accepts the examples and rejects bad
specs, in agreement with the operator's own validation (kvfleet.operator.spec).

No API server runs here, so the tests do its part: they apply the schema's defaults, validate with
jsonschema against the openAPIV3Schema, flag unknown fields (what strict field validation, kubectl's
default, rejects) and duplicate list-map keys, and evaluate every x-kubernetes-validations rule
with cel-python, a CEL implementation using RE2 like Kubernetes. Each rejected spec must also be
rejected by parse_spec, which the operator runs on every object it reconciles (the API server's
CEL check is not there on emulators or on a CRD installed without it), so the CEL rules and their
pydantic equivalents are held to the same answers.
"""

from __future__ import annotations

import copy
import re
import types
import typing
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pydantic
import pytest
import yaml

from kvfleet.operator import spec as spec_module
from kvfleet.operator.spec import InferenceServiceSpec, SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
SPEC_SCHEMA = SCHEMA["properties"]["spec"]
CEL_ENV = celpy.Environment()


# --- what the API server would do ---------------------------------------------------------------


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Structural defaulting: absent properties get their default, recursively (also inside
    a defaulted {})."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(value[key], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for item in value.values():
                apply_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def as_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI v3.0 schema node as JSON Schema draft 4 (which shares its exclusiveMinimum)."""
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in node:
        out["properties"] = {k: as_jsonschema(v) for k, v in node["properties"].items()}
    if "items" in node:
        out["items"] = as_jsonschema(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = as_jsonschema(node["additionalProperties"])
    return out


def unknown_fields(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found = []
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                found.append(f"{path}.{key}: unknown field")
            else:
                found += unknown_fields(item, schema["properties"][key], f"{path}.{key}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            found += unknown_fields(item, schema["additionalProperties"], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return found


def duplicate_keys(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    found = []
    if isinstance(value, list):
        keys = schema.get("x-kubernetes-list-map-keys")
        if schema.get("x-kubernetes-list-type") == "map" and keys:
            seen = [tuple(item.get(k) for k in keys) for item in value]
            if len(seen) != len(set(seen)):
                found.append(f"{path}: duplicate entries for keys {keys}")
        for i, item in enumerate(value):
            found += duplicate_keys(item, schema.get("items", {}), f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if key in schema.get("properties", {}):
                found += duplicate_keys(item, schema["properties"][key], f"{path}.{key}")
    return found


def typed(value: Any, schema: dict[str, Any]) -> Any:
    """JSON as the API server types it for CEL: `number` fields are doubles even when integral."""
    if schema.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: typed(v, props.get(k, {})) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v, schema.get("items", {})) for v in value]
    return value


def cel_rule_holds(rule: str, value: Any, schema: dict[str, Any], old: Any = None) -> bool:
    program = CEL_ENV.program(CEL_ENV.compile(rule))
    activation = {"self": celpy.json_to_cel(typed(value, schema))}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(typed(old, schema))
    return bool(program.evaluate(activation))


def cel_failures(value: Any, schema: dict[str, Any], old: Any = None) -> list[str]:
    """With old (an update), transition rules too: the API server skips them on a create."""
    failures = [
        rule["message"]
        for rule in schema.get("x-kubernetes-validations", [])
        if ("oldSelf" not in rule["rule"] or old is not None)
        and not cel_rule_holds(rule["rule"], value, schema, old)
    ]
    if isinstance(value, dict):
        for key, item in value.items():
            if key in schema.get("properties", {}):
                before = old.get(key) if isinstance(old, dict) else None
                failures += cel_failures(item, schema["properties"][key], before)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            failures += cel_failures(item, schema["items"])
    return failures


def crd_problems(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Why the API server would refuse the object, or the update from old (empty: it would
    store it)."""
    obj = apply_defaults(copy.deepcopy(obj), SCHEMA)
    old = apply_defaults(copy.deepcopy(old), SCHEMA) if old is not None else None
    problems = [
        e.message for e in jsonschema.Draft4Validator(as_jsonschema(SCHEMA)).iter_errors(obj)
    ]
    problems += unknown_fields(obj["spec"], SPEC_SCHEMA, "spec")
    problems += duplicate_keys(obj["spec"], SPEC_SCHEMA, "spec")
    if not problems:  # the API server evaluates CEL on objects that pass the schema
        problems += cel_failures(obj, SCHEMA, old)
    return problems


def isvc(spec: dict[str, Any], name: str = "llm") -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def examples() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "examples").glob("inferenceservice-*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "InferenceService"]
    return docs


def cel_rules(schema: dict[str, Any], path: str = "") -> list[tuple[str, str, str]]:
    rules = [
        (path or ".", r["rule"], r["message"]) for r in schema.get("x-kubernetes-validations", [])
    ]
    for key, sub in schema.get("properties", {}).items():
        rules += cel_rules(sub, f"{path}.{key}")
    if "items" in schema:
        rules += cel_rules(schema["items"], f"{path}[]")
    return rules


# --- the CRD itself ----------------------------------------------------------------------------


def test_crd_is_a_valid_custom_resource_definition():
    kubernetes_validate.validate(CRD, "1.30", strict=True)
    assert CRD["metadata"]["name"] == "inferenceservices.kvfleet.dev"
    assert CRD["spec"]["group"] == "kvfleet.dev"
    assert VERSION["name"] == "v1alpha1" and VERSION["served"] and VERSION["storage"]
    assert "isvc" not in CRD["spec"]["names"]["shortNames"]  # KServe's
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def schema_at(path: str) -> dict[str, Any]:
    node = SCHEMA
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_paths_and_printer_columns_exist_in_the_schema():
    assert schema_at(".spec.replicas")["type"] == "integer"
    assert schema_at(".status.replicas")["type"] == "integer"
    assert schema_at(".status.selector")["type"] == "string"
    columns = {c["name"]: c["jsonPath"] for c in VERSION["additionalPrinterColumns"]}
    assert set(columns) == {"Model", "Desired", "Ready-Replicas", "URL", "Ready", "Age"}
    for name, path in columns.items():
        if name not in ("Ready", "Age"):
            schema_at(path)
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path or ".", node)]
    for key, sub in node.get("properties", {}).items():
        nodes += walk(sub, f"{path}.{key}")
    if "items" in node:
        nodes += walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        nodes += walk(node["additionalProperties"], f"{path}{{}}")
    return nodes


def test_schema_is_structural():
    for path, node in walk(SCHEMA):
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        else:
            assert node.get("type") in {
                "object",
                "array",
                "string",
                "integer",
                "number",
                "boolean",
            }, path
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        if node.get("type") == "array":
            assert "items" in node, path
        for key in node.get("x-kubernetes-list-map-keys", []):
            assert key in node["items"].get("required", []), path
        if "default" in node:
            jsonschema.Draft4Validator(as_jsonschema(node)).validate(node["default"])
    # metadata may only be typed; the API server owns its schema.
    assert SCHEMA["properties"]["metadata"] == {"type": "object"}


# The CRDs Helm installs: crds/ (copied byte for byte, test_helm_chart.py) and kopf's peerings.
CHART_CRDS = [
    (path.name, crd)
    for path in sorted((ROOT / "charts" / "kvfleet" / "crds").glob("*.yaml"))
    for crd in yaml.safe_load_all(path.read_text())
]


def _stated_default(value: Any) -> str:
    if value == "":
        return "empty"
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize(
    "crd", [crd for _, crd in CHART_CRDS], ids=[crd["metadata"]["name"] for _, crd in CHART_CRDS]
)
def test_every_field_describes_itself(crd: dict[str, Any]):
    """`kubectl explain inferenceservice.spec --recursive` reads as documentation: every field
    has a description (metadata excepted: the API server publishes ObjectMeta's own), a scalar
    default is stated as "Default: <value>", and a *Seconds field says its unit."""
    assert len(CHART_CRDS) == 3
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        # Array items and map values are described by the field that holds them.
        fields = [(p, n) for p, n in walk(schema) if not p.endswith(("[]", "{}"))]
        undescribed = [p for p, n in fields if p != ".metadata" and not n.get("description")]
        assert undescribed == [], f"fields of {crd['metadata']['name']} without a description"
        for path, node in fields:
            default = node.get("default")
            if isinstance(default, str | int | float | bool):
                stated = re.escape(f"Default: {_stated_default(default)}")
                assert re.search(stated + r"([. ]|$)", node["description"]), path
            if path.endswith("Seconds"):
                assert "second" in node["description"].lower(), path


def test_every_cel_rule_compiles_and_mirrors_a_spec_check():
    rules = cel_rules(SCHEMA)
    for _, rule, _ in rules:
        CEL_ENV.compile(rule)
    messages = {message for _, _, message in rules}
    constants = {value for name, value in vars(spec_module).items() if name.startswith("MSG_")}
    assert messages == constants


def model_paths(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}.{field.alias or name}"
        paths.add(path)
        for inner in _nested_models(field.annotation):
            suffix = "[]" if _is_list(field.annotation) else ""
            paths |= model_paths(inner, path + suffix)
    return paths


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(a) is list for a in typing.get_args(annotation)
    )


def _nested_models(annotation: Any) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _nested_models(a)]
    return []


def test_spec_model_has_exactly_the_crd_fields():
    crd = {
        path
        for path, _ in walk(SPEC_SCHEMA)
        if path != "."
        and not re.search(r"(\[\]|\{\})$", path)
        and not path.startswith((".scheduling.affinity.", ".engine.env[].valueFrom."))
    }
    assert model_paths(InferenceServiceSpec) == crd


def test_spec_model_defaults_are_the_crd_defaults():
    raw: dict[str, Any] = {
        "apiKeySecretRef": {"name": "k"},
        "model": {"hfTokenSecretRef": {"name": "t"}},
        "adapters": [{"name": "a", "source": "hf://org/a", "hfTokenSecretRef": {"name": "u"}}],
    }
    defaulted = apply_defaults(copy.deepcopy(raw), SPEC_SCHEMA)
    defaulted["model"]["source"] = "hf://org/m"  # hfTokenSecretRef needs an hf:// source
    raw["model"]["source"] = "hf://org/m"
    model = InferenceServiceSpec.model_validate(raw).model_dump(by_alias=True, exclude_none=True)
    assert model == defaulted


# --- objects -------------------------------------------------------------------------------------


@pytest.mark.parametrize("obj", examples(), ids=lambda o: o["metadata"]["name"])
def test_examples_are_accepted(obj):
    assert crd_problems(obj) == []
    parse_spec(obj["metadata"]["name"], obj["spec"])


def test_examples_cover_cpu_gpu_and_tensor_parallel():
    gpus = sorted(o["spec"].get("resources", {}).get("gpus", 1) for o in examples())
    assert gpus[0] == 0 and gpus[-1] >= 1
    assert any(o["spec"].get("engine", {}).get("tensorParallelSize", 1) > 1 for o in examples())


M = spec_module
# (id, name, spec, the CEL message expected, or None when the schema itself refuses it)
INVALID: list[tuple[str, str, dict[str, Any], str | None]] = [
    ("gpu-util-zero", "llm", {"engine": {"gpuMemoryUtilization": 0}}, None),
    ("gpu-util-above-one", "llm", {"engine": {"gpuMemoryUtilization": 1.5}}, None),
    ("dtype", "llm", {"engine": {"dtype": "int8"}}, None),
    ("block-size", "llm", {"engine": {"blockSize": 32}}, None),
    ("max-num-seqs-zero", "llm", {"engine": {"maxNumSeqs": 0}}, None),
    ("mode", "llm", {"autoscaling": {"mode": "hpa"}}, None),
    ("negative-min", "llm", {"autoscaling": {"minReplicas": -1}}, None),
    ("negative-gpus", "llm", {"resources": {"gpus": -1}}, None),
    ("memory", "llm", {"resources": {"memory": "lots"}}, None),
    ("shared-memory", "llm", {"resources": {"sharedMemory": "2 GiB"}}, None),
    ("shared-memory-negative", "llm", {"resources": {"sharedMemory": "-1Gi"}}, None),
    ("shared-memory-bool", "llm", {"resources": {"sharedMemory": True}}, None),
    ("gpu-resource-name", "llm", {"resources": {"gpuResourceName": "gpu"}}, None),
    ("source-scheme", "llm", {"model": {"source": "s3://bucket/model"}}, None),
    ("hf-without-org", "llm", {"model": {"source": "hf://llama"}}, None),
    ("session-header", "llm", {"routing": {"sessionHeader": "x session"}}, None),
    ("load-factor", "llm", {"routing": {"loadFactor": 0.5}}, None),
    ("toleration-effect", "llm", {"scheduling": {"tolerations": [{"effect": "Sometimes"}]}}, None),
    ("unknown-field", "llm", {"engine": {"maxTokens": 5}}, None),
    ("duplicate-env", "llm", {"engine": {"env": [{"name": "A"}, {"name": "A"}]}}, None),
    # A budget that allows no eviction would block every node drain.
    ("budget-zero", "llm", {"engine": {"disruptionBudget": {"maxUnavailable": 0}}}, None),
    (
        "budget-zero-percent",
        "llm",
        {"routing": {"disruptionBudget": {"maxUnavailable": "0%"}}},
        None,
    ),
    (
        "budget-count-as-text",
        "llm",
        {"engine": {"disruptionBudget": {"maxUnavailable": "2"}}},
        None,
    ),
    ("min-above-max", "llm", {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, M.MSG_MIN_MAX),
    (
        "replicas-out-of-bounds",
        "llm",
        {"replicas": 5, "autoscaling": {"maxReplicas": 2}},
        M.MSG_REPLICAS_BOUNDS,
    ),
    (
        "external-without-replicas",
        "llm",
        {"autoscaling": {"mode": "external"}},
        M.MSG_EXTERNAL_REPLICAS,
    ),
    ("tp-without-gpus", "llm", {"engine": {"tensorParallelSize": 2}}, M.MSG_TP_GPUS),
    (
        "tp-with-fewer-gpus",
        "llm",
        {"engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}},
        M.MSG_TP_GPUS,
    ),
    (
        "tp-with-more-gpus",
        "llm",
        {"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 4}},
        M.MSG_TP_GPUS,
    ),
    (
        "cache-without-hf",
        "llm",
        {"model": {"source": "pvc://weights/m"}, "modelCache": {"claimName": "c"}},
        M.MSG_MODEL_CACHE_HF,
    ),
    (
        "token-without-hf",
        "llm",
        {"model": {"source": "/models/m", "hfTokenSecretRef": {"name": "t"}}},
        M.MSG_HF_TOKEN_HF,
    ),
    ("dotdot", "llm", {"model": {"source": "pvc://weights/../etc"}}, M.MSG_NO_DOTDOT),
    ("managed-flag", "llm", {"engine": {"extraArgs": ["--port", "9000"]}}, M.MSG_MANAGED_FLAGS),
    ("managed-flag-eq", "llm", {"engine": {"extraArgs": ["--model=/x"]}}, M.MSG_MANAGED_FLAGS),
    # argparse abbreviations of managed flags (issue 15): each prefix is refused by both.
    (
        "managed-flag-abbreviations",
        "llm",
        {"engine": {"extraArgs": ["--api", "k", "--hos", "0.0.0.0", "--por", "9999"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    (
        "managed-flag-abbrev-eq",
        "llm",
        {"engine": {"extraArgs": ["--por=9999"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    (
        "managed-flag-api-key-file",
        "llm",
        {"engine": {"extraArgs": ["--api-key-file=/k"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    (
        "managed-flag-spec-field",
        "llm",
        {"engine": {"extraArgs": ["--shutdown-timeout", "9"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    (
        "managed-flag-negation",
        "llm",
        {"engine": {"extraArgs": ["--no-enable-prefix"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    ("help", "llm", {"engine": {"extraArgs": ["--help"]}}, M.MSG_MANAGED_FLAGS),
    (
        "end-of-options",
        "llm",
        {"engine": {"extraArgs": ["--", "/other-model"]}},
        M.MSG_MANAGED_FLAGS,
    ),
    ("adapter-name", "llm", {"adapters": [{"name": "sql expert", "source": "/a"}]}, None),
    ("adapter-name-equals", "llm", {"adapters": [{"name": "a=b", "source": "/a"}]}, None),
    ("adapter-source-empty", "llm", {"adapters": [{"name": "a", "source": ""}]}, None),
    ("adapter-source-scheme", "llm", {"adapters": [{"name": "a", "source": "s3://b/a"}]}, None),
    ("adapter-without-source", "llm", {"adapters": [{"name": "a"}]}, None),
    (
        "adapter-token-without-hf",
        "llm",
        {"adapters": [{"name": "a", "source": "pvc://loras/a", "hfTokenSecretRef": {"name": "t"}}]},
        M.MSG_HF_TOKEN_HF,
    ),
    (
        "adapter-duplicate",
        "llm",
        {"adapters": [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]},
        None,
    ),
    (
        "adapters-too-many",
        "llm",
        {"adapters": [{"name": f"a{i}", "source": f"/a/{i}"} for i in range(M.MAX_ADAPTERS + 1)]},
        None,
    ),
    (
        "adapter-dotdot",
        "llm",
        {"adapters": [{"name": "a", "source": "pvc://loras/../etc"}]},
        M.MSG_NO_DOTDOT,
    ),
    (
        "adapter-rank",
        "llm",
        {"adapters": [{"name": "a", "source": "/a", "rank": 32}]},
        M.MSG_ADAPTER_RANK,
    ),
    (
        "adapter-rank-engine",
        "llm",
        {"adapters": [{"name": "a", "source": "/a", "rank": 64}], "engine": {"maxLoraRank": 32}},
        M.MSG_ADAPTER_RANK,
    ),
    ("cpu-loras", "llm", {"engine": {"maxLoras": 8, "maxCpuLoras": 4}}, M.MSG_CPU_LORAS),
    (
        "cpu-kv-cache-without-prefix-caching",
        "llm",
        {"engine": {"cpuKvCacheBytes": "1Gi", "enablePrefixCaching": False}},
        M.MSG_CPU_KV_CACHE,
    ),
    ("cpu-kv-cache-size", "llm", {"engine": {"cpuKvCacheBytes": "lots"}}, None),
    (
        "pooling-ttft",
        "llm",
        {"engine": {"runner": "pooling"}, "autoscaling": {"latencyTarget": {"targetSeconds": 1}}},
        M.MSG_POOLING_TTFT,
    ),
    ("managed-lora-flag", "llm", {"engine": {"extraArgs": ["--max-lora"]}}, M.MSG_MANAGED_FLAGS),
    ("name-format", "Llama_8B", {}, M.MSG_NAME_FORMAT),
    ("name-length", "l" * 57, {}, M.MSG_NAME_LENGTH),
]


@pytest.mark.parametrize(
    ("name", "spec", "message"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_specs_are_rejected_by_the_crd_and_the_operator(name, spec, message):
    problems = crd_problems(isvc(spec, name))
    assert problems, "the CRD accepts it"
    if message is not None:
        assert problems == [message]
    with pytest.raises(SpecError) as raised:
        parse_spec(name, spec)
    if message is not None:
        assert message in str(raised.value)


# Updates (id, old spec, new spec, the CEL message expected or None when stored). kubectl scale
# writes spec.replicas through /scale, which the API server validates like any update.
UPDATES: list[tuple[str, dict[str, Any], dict[str, Any], str | None]] = [
    ("scale-builtin-unset", {"autoscaling": {"maxReplicas": 4}},
     {"replicas": 3, "autoscaling": {"maxReplicas": 4}}, M.MSG_SCALE_BUILTIN),
    ("scale-builtin-set", {"replicas": 2, "autoscaling": {"maxReplicas": 4}},
     {"replicas": 3, "autoscaling": {"maxReplicas": 4}}, M.MSG_SCALE_BUILTIN),
    ("builtin-unchanged", {"replicas": 2, "autoscaling": {"maxReplicas": 4}},
     {"replicas": 2, "autoscaling": {"maxReplicas": 5}}, None),
    ("builtin-unset-replicas", {"replicas": 2, "autoscaling": {"maxReplicas": 4}},
     {"autoscaling": {"maxReplicas": 4}}, None),
    ("scale-external", {"replicas": 2, "autoscaling": {"mode": "external"}},
     {"replicas": 3, "autoscaling": {"mode": "external"}}, None),
    ("to-external", {"autoscaling": {"maxReplicas": 4}},
     {"replicas": 3, "autoscaling": {"mode": "external", "maxReplicas": 4}}, None),
    ("to-builtin", {"replicas": 2, "autoscaling": {"mode": "external", "maxReplicas": 4}},
     {"replicas": 3, "autoscaling": {"maxReplicas": 4}}, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "message"), [c[1:] for c in UPDATES], ids=[c[0] for c in UPDATES]
)
def test_builtin_mode_refuses_a_scale_request(old, new, message):
    assert crd_problems(isvc(new), isvc(old)) == ([message] if message else [])
    # Each spec alone is valid: creating it is allowed, and the operator acts on it (and says
    # with a Warning Event that it ignores the new replicas: test_status_backoff.py).
    assert crd_problems(isvc(new)) == []
    parse_spec("llm", new)


def test_every_cel_rule_has_an_invalid_case():
    exercised = {c[3] for c in INVALID} | {c[3] for c in UPDATES}
    assert {message for _, _, message in cel_rules(SCHEMA)} <= exercised
    assert len(INVALID) >= 10


def test_valid_edge_cases_pass_both():
    for spec in (
        {"autoscaling": {"minReplicas": 0, "maxReplicas": 3}},
        {"replicas": 0, "autoscaling": {"mode": "external", "minReplicas": 0}},
        {"replicas": 2, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}},
        {"model": {"source": "pvc://weights"}},
        {"model": {"source": "hf://Qwen/Qwen2.5-0.5B@v1.0"}, "modelCache": {"claimName": "c"}},
        {"resources": {"cpu": 2, "memory": "1.5Gi"}, "engine": {"extraArgs": ["--seed", "3"]}},
        # Flags the operator does not manage, negative values, and the negation of a switch.
        {"engine": {"extraArgs": ["--seed=-1", "--enforce-eager", "--no-skip-tokenizer-init"]}},
        {"engine": {"extraArgs": ["--num-gpu-blocks-override", "64", "--load-format", "auto"]}},
        {"engine": {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}},
        {"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 2}},
        {"engine": {"tensorParallelSize": 8}, "resources": {"gpus": 8, "sharedMemory": "8Gi"}},
        # An embedding engine's latency target is its queue time.
        {
            "engine": {"runner": "pooling"},
            "autoscaling": {"latencyTarget": {"metric": "queueTime", "targetSeconds": 1}},
        },
        # The rule binds tensorParallelSize > 1 only: several GPUs at 1 stay valid, as before.
        {"resources": {"gpus": 2}},
        {"resources": {"sharedMemory": "512Mi"}},
        {"resources": {"sharedMemory": 1073741824}},
        {"engine": {"disruptionBudget": {"maxUnavailable": "100%"}}},
        {"routing": {"disruptionBudget": {"maxUnavailable": 3}}},
        # Adapters of every source kind; modelCache with a non-hf:// model keeps their downloads.
        {
            "model": {"source": "pvc://weights/llama"},
            "modelCache": {"claimName": "cache"},
            "adapters": [
                {"name": "org/sql-v2", "source": "hf://org/sql-lora@v2", "rank": 16},
                {"name": "legal", "source": "pvc://loras/legal"},
                {"name": "chat:1.0", "source": "/adapters/chat"},
            ],
        },
        {"adapters": [{"name": "a", "source": "/a", "rank": 64}], "engine": {"maxLoraRank": 64}},
        {"engine": {"maxLoras": 16, "maxCpuLoras": 16}},
    ):
        assert crd_problems(isvc(spec)) == []
        parse_spec("llm", spec)


def test_an_adapter_named_as_the_base_model_is_refused_by_the_operator():
    """The CRD cannot derive the served name (a default of the source); the operator refuses
    the spec with InvalidSpec, and says why."""
    for model, name in (
        ({"source": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "meta-llama/Llama-3.1-8B-Instruct"),
        ({"source": "/models/m", "servedName": "llama"}, "llama"),
    ):
        spec = {"model": model, "adapters": [{"name": name, "source": "/a"}]}
        assert crd_problems(isvc(spec)) == []
        with pytest.raises(SpecError, match="the base model's served name"):
            parse_spec("llm", spec)


def test_shared_memory_defaults_and_int_form():
    assert parse_spec("llm", {}).resources.shared_memory == "2Gi"
    spec = parse_spec("llm", {"resources": {"sharedMemory": 1073741824}})
    assert spec.resources.shared_memory == "1073741824"
