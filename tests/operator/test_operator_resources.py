"""The operator's pure parts: desired-object builders, drift detection, status computation.

The children are checked against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict:
an unknown or misspelt field fails), then field by field for what the issue asks: owner
references, labels, probes, resources, the restricted security profile and model wiring.
"""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvfleet.operator import model_download
from kvfleet.operator import spec as spec_module
from kvfleet.operator.adapters import MODELS_DIR
from kvfleet.operator.admission import policy_violations
from kvfleet.operator.api import LABEL_ISVC, LABEL_MANAGED_BY
from kvfleet.operator.command_lines import router_args
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.drift import EXACT_PATHS, HASH_ANNOTATION, excess, in_sync, parse_quantity
from kvfleet.operator.main import build_parser, build_settings
from kvfleet.operator.rbac import OPERATOR_RULES, ROUTER_RULES, allows
from kvfleet.operator.resources import (
    CONFIG_HASH_ANNOTATION,
    Owner,
    build_children,
    engine_deployment,
    model_download_script,
    router_service,
)
from kvfleet.operator.spec import (
    DEMO_MODEL_NAME,
    InferenceServiceSpec,
    ModelSource,
    parse_source,
    parse_spec,
    replicas_from_spec,
    served_model_name,
)
from kvfleet.operator.status import Observed, compute_status, status_patch, transition_events

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="llm", namespace="team-a", uid="0b8f7c1e-0000-4000-8000-000000000001")
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")
NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
K8S_VERSION = "1.30"


def example(name: str) -> dict[str, Any]:
    docs = yaml.safe_load_all((ROOT / "examples" / name).read_text())
    return next(d for d in docs if d["kind"] == "InferenceService")


def spec_of(raw: dict[str, Any]) -> InferenceServiceSpec:
    return parse_spec("llm", raw)


def children(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objs = build_children(OWNER, spec_of(raw), CONFIG)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def container(deploy: dict[str, Any], name: str) -> dict[str, Any]:
    pod = deploy["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


LLAMA = example("inferenceservice-llama-3.1-8b.yaml")["spec"]
DEMO = example("inferenceservice-cpu-demo.yaml")["spec"]
QWEN_TP2 = example("inferenceservice-qwen2.5-32b-tp2.yaml")["spec"]
EXAMPLES = pytest.mark.parametrize(
    "raw", [DEMO, LLAMA, QWEN_TP2], ids=["cpu-demo", "llama", "qwen-tp2"]
)


@EXAMPLES
def test_children_are_valid_kubernetes_objects_owned_and_labelled(raw):
    objs = children(raw)
    assert set(objs) >= {
        "Deployment/llm-engine",
        "Service/llm-engine",
        "Deployment/llm-router",
        "Service/llm",
        "ServiceAccount/llm-router",
        "Role/llm-router",
        "RoleBinding/llm-router",
    }
    for obj in objs.values():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvfleet.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "llm",
                "uid": OWNER.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][LABEL_MANAGED_BY] == "kvfleet-operator"
        assert meta["labels"][LABEL_ISVC] == "llm"
        assert meta["annotations"][HASH_ANNOTATION]
    for name in ("Deployment/llm-engine", "Deployment/llm-router"):
        deploy = objs[name]
        selector = deploy["spec"]["selector"]["matchLabels"]
        template_labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= template_labels.items()
        assert template_labels[LABEL_MANAGED_BY] == "kvfleet-operator"


def test_only_hf_sources_get_the_download_config_map():
    assert "ConfigMap/llm-model-download" in children(LLAMA)
    assert "ConfigMap/llm-model-download" not in children(DEMO)
    cm = children(LLAMA)["ConfigMap/llm-model-download"]
    assert cm["data"]["download.py"] == model_download_script()


@EXAMPLES
def test_restricted_pod_security_on_every_container(raw):
    objs = children(raw)
    for name in ("Deployment/llm-engine", "Deployment/llm-router"):
        pod = objs[name]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["runAsNonRoot"] is True
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert sc.get("privileged") is not True
    engine_pod = objs["Deployment/llm-engine"]["spec"]["template"]["spec"]
    assert engine_pod["automountServiceAccountToken"] is False


def test_engine_probes_drain_and_grace_period():
    raw = copy.deepcopy(LLAMA)
    raw["engine"] |= {"startupTimeoutSeconds": 1200, "shutdownTimeoutSeconds": 45}
    deploy = children(raw)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    startup, live, ready = (engine[p] for p in ("startupProbe", "livenessProbe", "readinessProbe"))
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    # The startup probe covers the whole loading time before liveness takes over, and sees the
    # engine serving within a second (a request held at zero waits for it).
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200
    assert startup["periodSeconds"] == 1
    assert live["httpGet"]["path"] == "/health"
    assert ready["httpGet"]["path"] == "/ready"
    prestop = engine["lifecycle"]["preStop"]["exec"]["command"]
    assert prestop[0] == "sleep"
    grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > int(prestop[1]) + 45
    assert engine["args"][engine["args"].index("--shutdown-timeout") + 1] == "45"
    assert deploy["spec"]["progressDeadlineSeconds"] > 1200
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_gpu_resources_use_the_configured_resource_name():
    raw = copy.deepcopy(LLAMA)
    raw["resources"] = {"gpus": 2, "gpuResourceName": "amd.com/gpu", "cpu": 6, "memory": "40Gi"}
    deploy = children(raw)["Deployment/llm-engine"]
    res = container(deploy, "engine")["resources"]
    assert res["requests"] == {"cpu": "6", "memory": "40Gi", "amd.com/gpu": "2"}
    assert res["limits"] == {"memory": "40Gi", "amd.com/gpu": "2"}
    args = container(deploy, "engine")["args"]
    assert args[args.index("--device") + 1] == "cuda"
    # Several GPUs in one pod talk through /dev/shm: a Memory emptyDir replaces the 64 MiB one.
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}


@EXAMPLES
def test_pods_name_their_command_so_no_image_entrypoint_applies(raw):
    """The engine image's entrypoint is `kvfleet-engine serve` (docker run IMAGE [serve flags]):
    every container the operator runs from an image names its own command, so the pod's args
    never follow an entrypoint."""
    for deploy in ("Deployment/llm-engine", "Deployment/llm-router"):
        pod = children(raw)[deploy]["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c.get("command"), (deploy, c["name"])


def test_cpu_engine_requests_no_gpu():
    deploy = children(DEMO)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    assert not any("gpu" in k for k in engine["resources"]["requests"])
    args = engine["args"]
    assert args[args.index("--device") + 1] == "cpu"
    assert "--gpu-memory-utilization" not in args
    assert "dshm" not in {v["name"] for v in deploy["spec"]["template"]["spec"]["volumes"]}


def test_demo_model_wiring():
    engine = container(children(DEMO)["Deployment/llm-engine"], "engine")
    assert engine["command"] == ["kvfleet-engine"]
    assert "--model" not in engine["args"]
    assert engine["args"][engine["args"].index("--served-model-name") + 1] == DEMO_MODEL_NAME
    # Read-only root filesystem: the demo model is built under the writable /tmp.
    assert env_of(engine)["KVFLEET_CACHE_DIR"].startswith("/tmp/")
    assert {"name": "tmp", "mountPath": "/tmp"} in engine["volumeMounts"]


def test_path_model_wiring():
    raw = {"model": {"source": "/opt/models/qwen"}, "resources": {"gpus": 1}}
    deploy = children(raw)["Deployment/llm-engine"]
    args = container(deploy, "engine")["args"]
    assert args[args.index("--model") + 1] == "/opt/models/qwen"
    assert served_model_name(spec_of(raw)) == "qwen"
    assert "initContainers" not in deploy["spec"]["template"]["spec"]


def test_pvc_model_wiring():
    raw = {"model": {"source": "pvc://weights/llama/8b"}}
    deploy = children(raw)["Deployment/llm-engine"]
    pod = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    engine = container(deploy, "engine")
    mount = next(m for m in engine["volumeMounts"] if m["name"] == "model")
    assert mount["readOnly"] is True
    assert engine["args"][engine["args"].index("--model") + 1] == f"{mount['mountPath']}/llama/8b"
    assert served_model_name(spec_of(raw)) == "8b"


def test_hf_model_wiring():
    raw = copy.deepcopy(LLAMA)
    raw["model"]["source"] = "hf://meta-llama/Llama-3.1-8B-Instruct@refs/pr/7"
    deploy = children(raw)["Deployment/llm-engine"]
    pod = deploy["spec"]["template"]["spec"]
    download = container(deploy, "model-download")
    engine = container(deploy, "engine")
    env = env_of(download)
    assert env["MODEL_REPO"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert env["MODEL_REVISION"] == "refs/pr/7"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    # The engine loads what the init container wrote, from the same volume, read-only.
    model_path = engine["args"][engine["args"].index("--model") + 1]
    assert model_path == env["MODEL_DIR"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "llama-model-cache"}
    assert volumes["model-download"]["configMap"]["name"] == "llm-model-download"
    engine_mount = next(m for m in engine["volumeMounts"] if m["name"] == "models")
    assert engine_mount["readOnly"] is True and model_path.startswith(engine_mount["mountPath"])
    assert download["image"] == engine["image"] == CONFIG.engine_image
    assert CONFIG_HASH_ANNOTATION in deploy["spec"]["template"]["metadata"]["annotations"]
    assert env_of(engine)["HF_HUB_OFFLINE"] == "1"
    assert served_model_name(spec_of(raw)) == "meta-llama/Llama-3.1-8B-Instruct"

    del raw["modelCache"]
    pod = children(raw)["Deployment/llm-engine"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["models"] == {"name": "models", "emptyDir": {}}


def test_the_compile_cache_is_kept_on_the_model_cache_volume_else_on_tmp(tmp_path, monkeypatch):
    """With a model cache the engine's compile cache is the service's own folder of that volume
    (shared by its replicas and restarts, never by another service's engines), mounted writable
    while the models stay read-only; the download script makes the folder first, as the pod's
    user. Without one it is on the /tmp emptyDir."""
    deploy = children(LLAMA)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    cache_dir = env_of(engine)["KVFLEET_COMPILE_CACHE_DIR"]
    mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == cache_dir)
    assert mount["name"] == "models" and "readOnly" not in mount
    folder = env_of(container(deploy, "model-download"))[model_download.COMPILE_CACHE_ENV]
    assert folder == f"{MODELS_DIR}/{mount['subPath']}"
    assert mount["subPath"].endswith("/llm")
    models = next(m for m in engine["volumeMounts"] if m["mountPath"] == MODELS_DIR)
    assert models["readOnly"] is True

    # The script makes the folder whether its model is already downloaded or not.
    made = tmp_path / "cache" / mount["subPath"]
    monkeypatch.setenv(model_download.COMPILE_CACHE_ENV, str(made))
    monkeypatch.setattr(model_download, "download", lambda *a, **k: None)
    monkeypatch.setenv("MODEL_REPO", "org/m")
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "m"))
    assert model_download.main([]) == 0 and made.is_dir()

    raw = copy.deepcopy(LLAMA)
    del raw["modelCache"]
    deploy = children(raw)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    assert env_of(engine)["KVFLEET_COMPILE_CACHE_DIR"].startswith("/tmp/")
    assert model_download.COMPILE_CACHE_ENV not in env_of(container(deploy, "model-download"))
    assert all("subPath" not in m for m in engine["volumeMounts"])


def test_engine_flags_follow_the_spec():
    raw = {
        "model": {"source": "/m", "servedName": "my-model"},
        "engine": {
            "maxModelLen": 4096,
            "maxNumSeqs": 64,
            "maxNumBatchedTokens": 2048,
            "gpuMemoryUtilization": 0.85,
            "enablePrefixCaching": False,
            "dtype": "bfloat16",
            "maxWaitingRequests": 100,
            "extraArgs": ["--enforce-eager"],
            "image": "my/engine:dev",
        },
        "apiKeySecretRef": {"name": "keys"},
    }
    deploy = children(raw)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    args = engine["args"]

    def flag(name: str) -> str:
        return args[args.index(name) + 1]

    assert args[0] == "serve"
    assert (flag("--host"), flag("--port")) == ("0.0.0.0", "8000")
    assert flag("--served-model-name") == "my-model"
    assert flag("--max-model-len") == "4096"
    assert flag("--max-num-seqs") == "64"
    assert flag("--max-num-batched-tokens") == "2048"
    assert flag("--gpu-memory-utilization") == "0.85"
    assert flag("--dtype") == "bfloat16"
    assert flag("--block-size") == "16"
    assert flag("--max-waiting-requests") == "100"
    assert "--no-enable-prefix-caching" in args
    assert args[-1] == "--enforce-eager"
    # The API key reaches the engine only through its environment, from the Secret: nothing on
    # the command line, which the node's process table shows.
    assert not any(a.startswith("--api-key") or "KVFLEET_API_KEY" in a for a in args)
    assert env_of(engine)["KVFLEET_API_KEY"] == {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    assert engine["image"] == "my/engine:dev"
    assert "--tensor-parallel-size" not in args
    # Without maxNumSeqs or maxNumBatchedTokens the engine picks its defaults for its device.
    del raw["engine"]["maxNumSeqs"], raw["engine"]["maxNumBatchedTokens"]
    args = container(children(raw)["Deployment/llm-engine"], "engine")["args"]
    assert "--max-num-seqs" not in args and "--max-num-batched-tokens" not in args


def test_a_cpu_engine_without_a_token_budget_takes_the_engines_cpu_default():
    from kvfleet.engine.cli import build_parser
    from kvfleet.engine.engine_args import CPU_MAX_NUM_BATCHED_TOKENS, EngineArgs

    raw = {"model": {"source": "/m"}, "resources": {"gpus": 0}}
    ns = build_parser().parse_args(
        container(children(raw)["Deployment/llm-engine"], "engine")["args"]
    )
    engine = EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.model_fields})
    resolved = engine.for_device(engine.resolved_device())
    assert resolved.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS


def test_user_env_overrides_operator_defaults():
    raw = {"engine": {"env": [{"name": "HOME", "value": "/home/x"}, {"name": "A", "value": "1"}]}}
    env = container(children(raw)["Deployment/llm-engine"], "engine")["env"]
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/home/x"}]
    assert {"name": "A", "value": "1"} in env


def test_scheduling_applies_to_engine_pods_only():
    raw = {
        "scheduling": {
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "priorityClassName": "inference",
            "runtimeClassName": "nvidia",
            "affinity": {"nodeAffinity": {}},
        }
    }
    objs = children(raw)
    engine_pod = objs["Deployment/llm-engine"]["spec"]["template"]["spec"]
    assert engine_pod["nodeSelector"] == {"gpu": "h100"}
    assert engine_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert engine_pod["priorityClassName"] == "inference"
    assert engine_pod["runtimeClassName"] == "nvidia"
    assert engine_pod["affinity"] == {"nodeAffinity": {}}
    router_pod = objs["Deployment/llm-router"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in router_pod and "runtimeClassName" not in router_pod


@pytest.mark.parametrize("raw", [DEMO, LLAMA, QWEN_TP2], ids=["cpu-demo", "llama", "qwen-tp2"])
def test_the_engine_cli_accepts_the_arguments(raw):
    from kvfleet.engine.cli import build_parser

    engine = container(children(raw)["Deployment/llm-engine"], "engine")
    ns = build_parser().parse_args(engine["args"])
    spec = spec_of(raw)
    assert ns.command == "serve"
    assert ns.served_model_name == [served_model_name(spec)]
    assert ns.max_num_seqs == spec.engine.max_num_seqs
    assert ns.max_num_batched_tokens == spec.engine.max_num_batched_tokens
    assert ns.enable_prefix_caching is spec.engine.enable_prefix_caching
    assert ns.port == 8000 and ns.host == "0.0.0.0"
    assert ns.tensor_parallel_size == spec.engine.tensor_parallel_size


def dshm(deploy: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The /dev/shm volume of an engine Deployment and its mount, None where absent."""
    pod = deploy["spec"]["template"]["spec"]
    volume = next((v for v in pod["volumes"] if v["name"] == "dshm"), None)
    mount = next(
        (m for m in container(deploy, "engine")["volumeMounts"] if m["name"] == "dshm"), None
    )
    return volume, mount


def test_tensor_parallel_engine_gets_its_gpus_flag_and_shared_memory():
    deploy = children(QWEN_TP2)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--device") + 1] == "cuda"
    volume, mount = dshm(deploy)
    assert volume == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
    assert mount == {"name": "dshm", "mountPath": "/dev/shm"}

    raw = copy.deepcopy(QWEN_TP2)
    raw["resources"]["sharedMemory"] = "8Gi"
    volume, _ = dshm(children(raw)["Deployment/llm-engine"])
    assert volume is not None and volume["emptyDir"]["sizeLimit"] == "8Gi"


def test_single_gpu_engine_has_no_tensor_parallelism_and_no_shared_memory():
    deploy = children(LLAMA)["Deployment/llm-engine"]
    engine = container(deploy, "engine")
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "--tensor-parallel-size" not in engine["args"]
    assert dshm(deploy) == (None, None)
    # sharedMemory only sizes the volume of a multi-GPU pod; it adds none to a single-GPU one.
    raw = copy.deepcopy(LLAMA)
    raw["resources"]["sharedMemory"] = "8Gi"
    assert dshm(children(raw)["Deployment/llm-engine"]) == (None, None)


def test_router_cli_contract():
    # What the router Deployment runs: the ports the manifests declare included.
    args = container(children({})["Deployment/llm-router"], "router")["args"]
    assert args == [
        "--host", "0.0.0.0", "--port", "8080",
        "--engine-service", "llm-engine", "--namespace", "team-a", "--engine-port", "8000",
        "--session-header", "x-session-id", "--use-user-field", "--prefix-affinity",
        "--prefix-length", "256", "--load-factor", "1.25", "--hold-timeout", "120",
    ]  # fmt: skip
    routing = spec_of(
        {
            "routing": {
                "sessionHeader": "x-conversation",
                "useUserField": False,
                "prefixAffinity": False,
                "prefixLength": 64,
                "loadFactor": 2,
                "holdTimeoutSeconds": 5,
            }
        }
    ).routing
    args = router_args(port=1, engine_service="e", engine_port=2, namespace="n", routing=routing)
    assert "--no-use-user-field" in args and "--no-prefix-affinity" in args
    assert args[args.index("--session-header") + 1] == "x-conversation"
    assert args[args.index("--load-factor") + 1] == "2.0"


def test_router_deployment_services_and_rbac():
    objs = children({"routing": {"replicas": 3, "image": "my/router:1"}})
    router = objs["Deployment/llm-router"]
    assert router["spec"]["replicas"] == 3
    c = container(router, "router")
    assert c["image"] == "my/router:1"
    assert c["command"] == ["kvfleet-router"]
    assert c["args"][c["args"].index("--engine-service") + 1] == "llm-engine"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "llm-router"

    headless = objs["Service/llm-engine"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["ports"][0]["port"] == 8000
    front = objs["Service/llm"]["spec"]
    assert front["ports"][0] == {
        "name": "http",
        "port": 80,
        "targetPort": "http",
        "protocol": "TCP",
    }
    assert front["selector"] == router["spec"]["selector"]["matchLabels"]

    role = objs["Role/llm-router"]
    assert role["rules"] == list(ROUTER_RULES)
    binding = objs["RoleBinding/llm-router"]
    assert binding["roleRef"]["name"] == "llm-router"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "llm-router", "namespace": "team-a"}
    ]
    # Kubernetes lets the operator grant only what it holds itself.
    for rule in ROUTER_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert allows(OPERATOR_RULES, group, resource, verb)


def test_operator_settings_and_cli():
    standalone = build_settings()
    assert standalone.peering.standalone and standalone.scanning.disabled
    peered = build_settings("kvfleet")
    assert peered.peering.name == "kvfleet" and peered.peering.mandatory
    assert peered.peering.priority != build_settings("kvfleet").peering.priority
    ns = build_parser().parse_args(["run", "-n", "a,b", "-n", "c", "--peering", "p"])
    assert ns.namespace == ("a", "b", "c") and ns.peering == "p"


def test_replicas_from_spec():
    assert replicas_from_spec(spec_of({})) == 1
    assert replicas_from_spec(spec_of({"autoscaling": {"minReplicas": 0, "maxReplicas": 3}})) == 1
    assert replicas_from_spec(spec_of({"autoscaling": {"minReplicas": 2, "maxReplicas": 3}})) == 2
    assert replicas_from_spec(spec_of({"replicas": 3, "autoscaling": {"maxReplicas": 4}})) == 3
    external = {"replicas": 0, "autoscaling": {"mode": "external", "minReplicas": 0}}
    assert replicas_from_spec(spec_of(external)) == 0
    assert children(external)["Deployment/llm-engine"]["spec"]["replicas"] == 0


def test_model_sources():
    assert parse_source("").kind == "demo"
    hf = parse_source("hf://Qwen/Qwen2.5-0.5B-Instruct")
    assert (hf.kind, hf.repo, hf.revision) == ("hf", "Qwen/Qwen2.5-0.5B-Instruct", "main")
    pvc = parse_source("pvc://models")
    assert (pvc.kind, pvc.claim, pvc.path) == ("pvc", "models", "")
    assert served_model_name(spec_of({"model": {"source": "pvc://models"}})) == "models"


def test_the_model_source_is_parsed_once_with_the_spec(monkeypatch):
    raw = {"model": {"source": "hf://org/m@v2"}, "modelCache": {"claimName": "cache"}}
    spec = spec_of(raw)
    assert spec.model.parsed_source == ModelSource(kind="hf", repo="org/m", revision="v2")
    assert spec.model.model_dump(by_alias=True, exclude_none=True) == {"source": "hf://org/m@v2"}

    class Refuse:
        def match(self, source: str) -> None:
            raise AssertionError(f"{source!r} parsed again after the spec was")

    # Building every child and the served name reads the parsed source, never the string.
    monkeypatch.setattr(spec_module, "HF_SOURCE_RE", Refuse())
    build_children(OWNER, spec, CONFIG, 2)
    assert served_model_name(spec) == "org/m"


def test_demo_model_name_matches_the_engine():
    from kvfleet.engine.default_model import DEFAULT_MODEL_NAME

    assert DEMO_MODEL_NAME == DEFAULT_MODEL_NAME


# --- drift -------------------------------------------------------------------------------------


def served(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as an API server returns it: defaults, status and metadata added."""
    live = copy.deepcopy(obj)
    live["metadata"] |= {"uid": "u", "resourceVersion": "7", "generation": 2}
    live["metadata"]["labels"]["extra"] = "added-by-someone"
    pod = live["spec"]["template"]["spec"]
    pod |= {"restartPolicy": "Always", "dnsPolicy": "ClusterFirst", "schedulerName": "default"}
    c = pod["containers"][0]
    c["imagePullPolicy"] = "IfNotPresent"
    requests = c["resources"]["requests"]
    requests["cpu"] = f"{parse_quantity(requests['cpu']) * 1000:f}m"  # "4" -> "4000m"
    requests["memory"] = f"{parse_quantity(requests['memory']):f}"  # "32Gi" -> bytes
    c["livenessProbe"]["successThreshold"] = 1
    live["status"] = {"replicas": 1}
    return live


def test_in_sync_ignores_what_the_server_adds():
    desired = engine_deployment(OWNER, spec_of({}), CONFIG)
    assert in_sync(desired, served(desired))


def test_in_sync_sees_hand_edits_and_spec_changes():
    desired = engine_deployment(OWNER, spec_of({}), CONFIG)
    edited = served(desired)
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    assert not in_sync(desired, edited)
    edited = served(desired)
    edited["spec"]["replicas"] = 5
    assert not in_sync(desired, edited)
    # A change that only removes a field is invisible to a containment check: the hash sees it.
    with_env = engine_deployment(OWNER, spec_of({"engine": {"env": [{"name": "X"}]}}), CONFIG)
    assert not in_sync(desired, served(with_env))


def test_in_sync_with_the_shared_memory_volume_as_served_and_restores_it():
    desired = engine_deployment(OWNER, spec_of(QWEN_TP2), CONFIG)
    live = served(desired)
    volume = next(v for v in live["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    volume["emptyDir"]["sizeLimit"] = "2048Mi"  # how a server may spell the same quantity
    assert in_sync(desired, live)

    removed = served(desired)
    pod = removed["spec"]["template"]["spec"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
    assert not in_sync(desired, removed)
    unmounted = served(desired)
    engine = unmounted["spec"]["template"]["spec"]["containers"][0]
    engine["volumeMounts"] = [m for m in engine["volumeMounts"] if m["name"] != "dshm"]
    assert not in_sync(desired, unmounted)
    shrunk = served(desired)
    volume = next(v for v in shrunk["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")
    volume["emptyDir"]["sizeLimit"] = "64Mi"
    assert not in_sync(desired, shrunk)


SCHEDULED = {
    "scheduling": {
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
}


def test_nothing_is_excess_in_what_the_server_serves():
    for desired in (
        engine_deployment(OWNER, spec_of(SCHEDULED), CONFIG),
        engine_deployment(OWNER, spec_of(QWEN_TP2), CONFIG),
        router_service(OWNER),
    ):
        assert excess(desired, served(desired) if desired["kind"] == "Deployment" else desired) is (
            None
        )


def test_a_key_added_to_the_service_selector_is_excess():
    desired = router_service(OWNER)
    live = copy.deepcopy(desired)
    live["metadata"]["resourceVersion"] = "41"
    live["spec"]["selector"]["app"] = "evil"
    assert in_sync(desired, live)  # containment alone cannot see it
    found = excess(desired, live)
    assert found is not None and found.paths == ["spec.selector"]
    assert found.patch == {
        "spec": {"selector": {"app": None}},
        "metadata": {"resourceVersion": "41"},
    }


def test_added_scheduling_and_containers_are_excess_an_added_env_var_is_not():
    desired = engine_deployment(OWNER, spec_of(SCHEDULED), CONFIG)
    live = served(desired)
    pod = live["spec"]["template"]["spec"]
    pod["containers"][0]["env"].append({"name": "ADDED_BY_SOMEONE", "value": "1"})
    assert excess(desired, live) is None
    pod["nodeSelector"]["kubernetes.io/hostname"] = "no-such-node"
    pod["nodeName"] = "no-such-node"
    pod["tolerations"].append({"key": "any", "operator": "Exists"})
    pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}
    pod["containers"].append({"name": "miner", "image": "evil:latest"})
    found = excess(desired, live)
    assert found is not None
    assert found.paths == [".".join(path) for path, _ in EXACT_PATHS["Deployment"][:5]]
    patched = found.patch["spec"]["template"]["spec"]
    assert patched["nodeSelector"] == {"kubernetes.io/hostname": None}
    assert patched["nodeName"] is None
    assert patched["tolerations"] == desired["spec"]["template"]["spec"]["tolerations"]
    assert patched["affinity"] == {"nodeAffinity": None}
    # The engine container stays as served, with the env var someone else added.
    assert patched["containers"] == [served_engine := pod["containers"][0]]
    assert served_engine["env"][-1]["name"] == "ADDED_BY_SOMEONE"


def test_a_term_added_inside_a_desired_affinity_is_excess():
    term = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}
    raw = {"scheduling": {"affinity": {"nodeAffinity": required}}}
    desired = engine_deployment(OWNER, spec_of(raw), CONFIG)
    live = served(desired)
    affinity = live["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert excess(desired, live) is None
    terms[0]["matchExpressions"].append({"key": "zone", "operator": "In", "values": ["none"]})
    found = excess(desired, live)
    assert found is not None and found.paths == ["spec.template.spec.affinity"]
    assert excess(desired, _applied(live, found.patch)) is None


def _applied(live: dict[str, Any], patch: Any) -> Any:
    """A JSON merge patch (RFC 7386) applied."""
    if not isinstance(patch, dict):
        return patch
    out = dict(live) if isinstance(live, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _applied(out.get(key), value)
    return out


def test_quantities():
    assert parse_quantity("4000m") == parse_quantity("4") == parse_quantity(4)
    assert parse_quantity("1Gi") == 2**30
    assert parse_quantity("1.5G") == 1_500_000_000
    assert parse_quantity("1e3") == 1000


# --- status ------------------------------------------------------------------------------------


def deployment(replicas: int, ready: int, generation: int = 1, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": generation,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
            ],
            **status,
        },
    }


def pod(name: str, component: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": component}},
        "status": status,
    }


def observed(**kw: Any) -> Observed:
    base: dict[str, Any] = {
        "generation": 3,
        "selector": "s",
        "previous": {},
        "desired_replicas": 2,
        "model_name": "m",
        "url": "http://llm.team-a.svc/v1",
        "engine": deployment(2, 2),
        "router": deployment(1, 1),
    }
    return Observed(**(base | kw))


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_ready_when_router_and_an_engine_are_ready():
    status = compute_status(observed(), NOW)
    cond = conditions(status)
    assert cond["Ready"]["status"] == "True"
    assert cond["Progressing"]["status"] == "False"
    assert cond["Degraded"]["status"] == "False"
    assert all(c["observedGeneration"] == 3 for c in cond.values())
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 2, 2)
    assert compute_status(observed(router=deployment(1, 0)), NOW)["conditions"][0]["status"] == (
        "False"
    )
    no_engine = conditions(compute_status(observed(engine=deployment(2, 0)), NOW))
    assert (no_engine["Ready"]["status"], no_engine["Ready"]["reason"]) == (
        "False",
        "EngineNotReady",
    )


def test_progressing_during_a_rollout():
    rolling = deployment(2, 2, generation=4)
    rolling["status"]["observedGeneration"] = 3
    cond = conditions(compute_status(observed(engine=rolling), NOW))
    assert (cond["Progressing"]["status"], cond["Progressing"]["reason"]) == ("True", "RollingOut")
    half = deployment(2, 2, updatedReplicas=1)
    assert conditions(compute_status(observed(engine=half), NOW))["Progressing"]["status"] == "True"
    # A first rollout waits for its pods to become available (the model is loading).
    loading = deployment(2, 0, conditions=[{"type": "Progressing", "reason": "ReplicaSetUpdated"}])
    cond = conditions(compute_status(observed(engine=loading), NOW))
    assert cond["Progressing"]["status"] == "True"
    assert "0 of 2 updated replicas available" in cond["Progressing"]["message"]


@pytest.mark.parametrize(
    ("pods", "reason", "words"),
    [
        (
            [
                pod(
                    "e1",
                    "engine",
                    containerStatuses=[
                        {
                            "name": "engine",
                            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                            "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                        }
                    ],
                )
            ],
            "CrashLoopBackOff",
            ["engine pod e1", "crash-looping", "137", "OOMKilled"],
        ),
        (
            [
                pod(
                    "r1",
                    "router",
                    containerStatuses=[
                        {
                            "name": "router",
                            "image": "nope:1",
                            "state": {"waiting": {"reason": "ImagePullBackOff", "message": "x"}},
                        }
                    ],
                )
            ],
            "ImagePullError",
            ["router pod r1", "nope:1"],
        ),
        (
            [
                pod(
                    "e1",
                    "engine",
                    initContainerStatuses=[
                        {
                            "name": "model-download",
                            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                            "lastState": {"terminated": {"exitCode": 1}},
                        }
                    ],
                )
            ],
            "ModelDownloadFailed",
            ["model-download"],
        ),
        (
            [
                pod(
                    "e1",
                    "engine",
                    conditions=[
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                        }
                    ],
                )
            ],
            "Unschedulable",
            ["Insufficient nvidia.com/gpu"],
        ),
        (
            [
                pod(
                    "e1",
                    "engine",
                    containerStatuses=[
                        {
                            "name": "engine",
                            "state": {
                                "waiting": {
                                    "reason": "CreateContainerConfigError",
                                    "message": 'secret "keys" not found',
                                }
                            },
                        }
                    ],
                )
            ],
            "ContainerConfigError",
            ['secret "keys" not found'],
        ),
    ],
    ids=["crash-loop", "image-pull", "download", "unschedulable", "config"],
)
def test_degraded_with_a_reason(pods, reason, words):
    cond = conditions(compute_status(observed(pods=pods, engine=deployment(2, 1)), NOW))
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", reason)
    for word in words:
        assert word in cond["Degraded"]["message"]
    # One engine replica still serves: degraded, but ready.
    assert cond["Ready"]["status"] == "True"


def ready_pod(
    name: str, component: str, ip: str | None = "10.0.0.7", **meta: Any
) -> dict[str, Any]:
    obj = pod(name, component, conditions=[{"type": "Ready", "status": "True"}])
    obj["metadata"] |= meta
    if ip is not None:
        obj["status"]["podIP"] = ip
    return obj


def test_a_ready_pod_without_an_ip_is_degraded_and_not_counted_as_serving():
    # Two ready engines, one without an IP (a network plugin that failed, a status written by
    # hand): one still serves, and the status says which pod does not.
    pods = [
        ready_pod("e1", "engine", ip=None),
        ready_pod("e2", "engine"),
        ready_pod("r1", "router"),
    ]
    status = compute_status(observed(pods=pods), NOW)
    cond = conditions(status)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "Serving")
    assert cond["Ready"]["message"].endswith("; without a pod IP: engine pod e1")
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "PodWithoutIP")
    assert "engine pod e1 is Ready but has no pod IP" in cond["Degraded"]["message"]
    events = transition_events(compute_status(observed(), NOW)["conditions"], status["conditions"])
    assert [(e.type, e.reason) for e in events] == [("Warning", "PodWithoutIP")]

    # The only ready engine has no IP: nothing serves.
    alone = [ready_pod("e1", "engine", ip=None), ready_pod("r1", "router")]
    cond = conditions(compute_status(observed(pods=alone, engine=deployment(1, 1)), NOW))
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "EngineWithoutIP")
    router = [ready_pod("e1", "engine"), ready_pod("r1", "router", ip="")]
    cond = conditions(compute_status(observed(pods=router), NOW))
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "RouterWithoutIP")
    assert "router pod r1" in cond["Degraded"]["message"]


def test_pods_without_an_ip_that_are_not_ready_or_leaving_are_no_problem():
    pods = [
        pod("e1", "engine", phase="Pending"),  # not scheduled yet: no IP is normal
        ready_pod("e2", "engine", ip=None, deletionTimestamp="2026-01-02T03:04:05Z"),
        ready_pod("e4", "engine"),
    ]
    cond = conditions(compute_status(observed(pods=pods), NOW))
    assert (cond["Degraded"]["status"], cond["Ready"]["message"]) == (
        "False",
        "2 of 2 engine and 1 of 1 router replicas ready",
    )


def test_invalid_spec_is_degraded_and_not_progressing():
    status = compute_status(observed(spec_error="spec.x: bad", desired_replicas=None), NOW)
    cond = conditions(status)
    assert (cond["Degraded"]["reason"], cond["Degraded"]["message"]) == (
        "InvalidSpec",
        "spec.x: bad",
    )
    assert cond["Progressing"]["status"] == "False"


def test_unchanged_status_needs_no_patch_and_keeps_transition_times():
    first = compute_status(observed(), NOW)
    later = NOW + datetime.timedelta(hours=1)
    again = compute_status(observed(previous=first), later)
    assert status_patch(first, again) == {}
    assert transition_events(first["conditions"], again["conditions"]) == []
    broken = compute_status(observed(previous=first, engine=deployment(2, 0)), later)
    ready = conditions(broken)["Ready"]
    assert ready["lastTransitionTime"] == "2026-01-02T04:04:05Z"
    assert conditions(broken)["Degraded"]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    patch = status_patch(first, broken)
    assert set(patch) == {"readyReplicas", "conditions"}
    events = transition_events(first["conditions"], broken["conditions"])
    assert [(e.type, e.reason) for e in events] == [("Warning", "EngineNotReady")]


def test_status_patch_removes_a_vanished_url():
    first = compute_status(observed(), NOW)
    assert status_patch(first, compute_status(observed(previous=first, url=None), NOW)) == {
        "url": None
    }


# --- the model download script -----------------------------------------------------------------


def test_model_download_runs_once_per_directory(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(**kw: Any) -> str:
        calls.append(kw)
        (Path(kw["local_dir"]) / "model.safetensors").write_bytes(b"x")
        return str(kw["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    target = tmp_path / "org--m" / "main"
    model_download.download("org/m", "main", target)
    model_download.download("org/m", "main", target)
    assert len(calls) == 1
    assert calls[0]["repo_id"] == "org/m" and calls[0]["revision"] == "main"
    assert "*.safetensors" in calls[0]["allow_patterns"]
    assert (target / model_download.COMPLETE_MARKER).exists()


def test_adapter_downloads_use_their_own_token_else_the_default(tmp_path, monkeypatch):
    import huggingface_hub

    tokens = []

    def fake_snapshot_download(**kw: Any) -> str:
        tokens.append(kw["token"])
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (Path(kw["local_dir"]) / name).write_text("{}")
        return str(kw["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_TOKEN_ABC", "tenant-secret")
    monkeypatch.delenv("HF_TOKEN_MISSING", raising=False)
    listing = tmp_path / "downloads.json"
    items = [
        {"repo": f"org/{n}", "revision": "main", "dir": str(tmp_path / n)} for n in ("a", "b", "c")
    ]
    items[0]["token_env"] = "HF_TOKEN_ABC"
    items[2]["token_env"] = "HF_TOKEN_MISSING"
    listing.write_text(json.dumps(items))
    assert model_download.download_adapters(listing) == 0
    # None: huggingface_hub's own default, the HF_TOKEN of the model's Secret.
    assert tokens == ["tenant-secret", None, None]


def test_model_download_refuses_checkpoints_without_safetensors(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: str(kw["local_dir"]))
    with pytest.raises(RuntimeError, match="safetensors"):
        model_download.download("org/m", "main", tmp_path / "m")
    assert not (tmp_path / "m" / model_download.COMPLETE_MARKER).exists()


def test_a_spec_without_gpus_gets_the_cpu_engine_image_by_default():
    config = OperatorConfig(
        engine_image="registry/engine:1",
        router_image="registry/operator:1",
        engine_cpu_image="registry/engine:1-cpu",
    )

    def image(raw: dict[str, Any], cfg: OperatorConfig = config) -> str:
        return container(engine_deployment(OWNER, spec_of(raw), cfg), "engine")["image"]

    assert image({"resources": {"gpus": 0}}) == "registry/engine:1-cpu"
    assert image({"resources": {"gpus": 1}}) == "registry/engine:1"
    assert image({"resources": {"gpus": 0}, "engine": {"image": "mine/engine:2"}}) == (
        "mine/engine:2"
    )
    # No CPU image configured: one image for both.
    no_cpu_image = config.model_copy(update={"engine_cpu_image": None})
    assert image({"resources": {"gpus": 0}}, no_cpu_image) == config.engine_image
    # Either default passes the allow-list, whatever the spec's GPUs.
    strict = config.model_copy(update={"allowed_images": ()})
    for named in (config.engine_image, config.engine_cpu_image):
        raw = {"resources": {"gpus": 0}, "engine": {"image": named}}
        assert policy_violations(spec_of(raw), strict) == []
    other = {"resources": {"gpus": 0}, "engine": {"image": "elsewhere/engine:1"}}
    assert [v.reason for v in policy_violations(spec_of(other), strict)] == ["ImageNotAllowed"]
