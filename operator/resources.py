"""The objects an InferenceService owns, built from its spec by pure functions (no I/O).

Per InferenceService ``<name>`` in namespace ``<ns>``:

* Deployment ``<name>-engine`` and headless Service ``<name>-engine``: the engine pods, which the
  router finds through the Service's EndpointSlices.
* Deployment ``<name>-router`` and Service ``<name>``: the router, the user-facing URL
  ``http://<name>.<ns>.svc/v1``.
* ServiceAccount, Role and RoleBinding ``<name>-router``: the router may read EndpointSlices in
  its own namespace, nothing else (see rbac.py).
* ConfigMap ``<name>-model-download`` for hf:// models and adapters: the download script of the
  init container (and of the adapter downloader).
* ConfigMap ``<name>-adapters`` when the spec has adapters: their list, which the engine pods
  read (adapters.py).
* PodDisruptionBudgets ``<name>-engine`` and ``<name>-router``: how many engine and router pods a
  node drain may evict at once (spec.engine.disruptionBudget, spec.routing.disruptionBudget).

Every object carries the common labels, a controller owner reference to the InferenceService
(garbage collection deletes the children with it) and the hash annotation of drift.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet.operator import adapters, model_download
from kvfleet.operator.adapters import MODELS_DIR, PVC_MOUNT, hf_dir
from kvfleet.operator.api import (
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_ISVC,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
)
from kvfleet.operator.command_lines import engine_args, router_args
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.drift import with_hash
from kvfleet.operator.rbac import ROUTER_RULES, as_manifest
from kvfleet.operator.spec import (
    DisruptionBudgetSpec,
    HFTokenSecretRef,
    InferenceServiceSpec,
    replicas_from_spec,
)
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT

CONFIG_HASH_ANNOTATION = "kvfleet.dev/config-hash"
ADAPTERS_HASH_ANNOTATION = "kvfleet.dev/adapters-hash"

SERVICE_PORT = 80
# Seconds between the pod leaving the endpoints and SIGTERM: routers and kube-proxy stop
# sending new requests before the engine starts refusing them.
PRESTOP_SLEEP_SECONDS = 5
# After the engine's --shutdown-timeout: aborting what is left, freeing its blocks, stopping the
# tensor-parallel workers and exiting, before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_SECONDS = 15

SCRIPT_DIR = "/etc/kvfleet/model-download"
# The engine's compile cache (Triton's kernels, the memory profile): when the spec has a model
# cache volume, the service's own folder of it, shared by its replicas and restarts, which the
# download init container makes (a subPath kubelet made would be root's, not writable by the
# engine's user), else on the pod's /tmp emptyDir, which a container restart keeps. Its own:
# the folder holds code the engines load (Triton's launchers), and a claim may be shared by
# several services, so no engine writes where another service's engines read.
COMPILE_CACHE_MOUNT = "/var/cache/kvfleet-compile"
COMPILE_CACHE_ROOT = ".kvfleet-compile-cache"
COMPILE_CACHE_TMP = "/tmp/kvfleet/compile-cache"
SCRIPT_FILE = "download.py"
RUN_AS = 1000


@dataclass(frozen=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class ChildRef:
    api_version: str
    kind: str
    plural: str
    name: str


def engine_name(name: str) -> str:
    return f"{name}-engine"


def router_name(name: str) -> str:
    return f"{name}-router"


def download_config_name(name: str) -> str:
    return f"{name}-model-download"


def service_url(owner: Owner) -> str:
    """The OpenAI base URL of the service, inside the cluster."""
    return f"http://{owner.name}.{owner.namespace}.svc/v1"


def common_labels(name: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "kvfleet",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ISVC: name,
    }


def selector_labels(name: str, component: str) -> dict[str, str]:
    # Immutable on a Deployment once created: only labels that never change for its lifetime.
    return {LABEL_ISVC: name, LABEL_COMPONENT: component}


def engine_selector(name: str) -> str:
    """The engine pods' label selector as a string: status.selector, for HPA through /scale."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name, "engine").items()))


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": common_labels(owner.name, component),
        "ownerReferences": [owner_reference(owner)],
    }


def _restricted_container_security() -> dict[str, Any]:
    # The "restricted" Pod Security Standard, plus a read-only root filesystem.
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _restricted_pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        # Lets the non-root user write the model-cache volume; OnRootMismatch skips the slow
        # recursive chown of a large, already-owned model directory on every start.
        "fsGroup": RUN_AS,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _prestop() -> dict[str, Any]:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}


def _http_probe(path: str, *, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def model_download_script() -> str:
    # The module's own file: kvfleet.operator is a namespace package, which
    # importlib.resources cannot read in pip's default editable mode (its path is a
    # MultiplexedPath there).
    return Path(model_download.__file__).read_text()


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    """The pods' grace period, from the number the engine gets as --shutdown-timeout: the preStop
    sleep counts against it, then SIGTERM drains for shutdownTimeoutSeconds, then the margin."""
    return PRESTOP_SLEEP_SECONDS + spec.engine.shutdown_timeout_seconds + SHUTDOWN_MARGIN_SECONDS


@dataclass
class _ModelWiring:
    """How the model reaches the engine container: its path, volumes and an init container."""

    path: str | None = None
    volumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    mounts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    init_containers: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def _model_wiring(owner: Owner, spec: InferenceServiceSpec, image: str) -> _ModelWiring:
    src = spec.model.parsed_source
    match src.kind:
        case "demo":
            return _ModelWiring()
        case "path":
            return _ModelWiring(path=src.path)
        case "pvc":
            return _ModelWiring(
                path=f"{PVC_MOUNT}/{src.path}".rstrip("/"),
                volumes=[
                    {
                        "name": "model",
                        "persistentVolumeClaim": {"claimName": src.claim, "readOnly": True},
                    }
                ],
                mounts=[{"name": "model", "mountPath": PVC_MOUNT, "readOnly": True}],
            )
    model_dir = hf_dir(src.repo, src.revision)
    env: list[dict[str, Any]] = [
        {"name": "MODEL_REPO", "value": src.repo},
        {"name": "MODEL_REVISION", "value": src.revision},
        {"name": "MODEL_DIR", "value": model_dir},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *_compile_cache_folder_env(owner, spec),
    ]
    if (ref := spec.model.hf_token_secret_ref) is not None:
        env.append(_secret_env("HF_TOKEN", ref))
    download = {
        "name": "model-download",
        "image": image,
        **_pull_policy(spec),
        "command": ["python3", f"{SCRIPT_DIR}/{SCRIPT_FILE}"],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "securityContext": _restricted_container_security(),
        "volumeMounts": _download_mounts(),
    }
    return _ModelWiring(
        path=model_dir,
        volumes=_download_volumes(owner, spec),
        mounts=[{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}],
        init_containers=[download],
    )


def _secret_env(name: str, ref: HFTokenSecretRef, *, optional: bool = False) -> dict[str, Any]:
    key_ref: dict[str, Any] = {"name": ref.name, "key": ref.key}
    if optional:
        key_ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": key_ref}}


def _download_volumes(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The model cache volume and the download script, for hf:// models and adapters."""
    models: dict[str, Any] = (
        {"name": "models", "persistentVolumeClaim": {"claimName": spec.model_cache.claim_name}}
        if spec.model_cache is not None
        else {"name": "models", "emptyDir": {}}
    )
    script = {
        "name": "model-download",
        "configMap": {"name": download_config_name(owner.name), "defaultMode": 0o444},
    }
    return [models, script]


def _compile_cache_subpath(owner: Owner) -> str:
    return f"{COMPILE_CACHE_ROOT}/{owner.name}"


def _compile_cache_folder_env(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The download script makes the compile cache's folder on the model cache volume."""
    if spec.model_cache is None:
        return []
    folder = f"{MODELS_DIR}/{_compile_cache_subpath(owner)}"
    return [{"name": model_download.COMPILE_CACHE_ENV, "value": folder}]


def _compile_cache_mounts(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The service's compile cache on the model cache volume, writable; none without one."""
    if spec.model_cache is None:
        return []
    subpath = _compile_cache_subpath(owner)
    return [{"name": "models", "mountPath": COMPILE_CACHE_MOUNT, "subPath": subpath}]


def _download_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "models", "mountPath": MODELS_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-download", "mountPath": SCRIPT_DIR, "readOnly": True},
    ]


# How often the adapter downloader rereads the adapters ConfigMap for hf:// adapters to fetch.
ADAPTER_DOWNLOAD_INTERVAL_SECONDS = 15


def _adapter_wiring(
    owner: Owner, spec: InferenceServiceSpec, image: str, model: _ModelWiring
) -> list[dict[str, Any]]:
    """Adds what adapters need to the model's wiring: the adapters ConfigMap, the model cache
    volume (hf:// adapters are downloaded into it, by an init container before the engine
    starts and by a container beside it for those added later) and the pvc:// adapters'
    claims. Returns the containers beside the engine. Nothing here depends on the adapters'
    names or hf:// sources, so editing them changes no template (adapters.py)."""
    if not any(v["name"] == "models" for v in model.volumes):
        model.volumes += _download_volumes(owner, spec)
        model.mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    config = {"name": "adapters", "mountPath": adapters.ADAPTERS_DIR, "readOnly": True}
    model.volumes.append(
        {
            "name": "adapters",
            "configMap": {
                "name": adapters.adapters_config_name(owner.name),
                "defaultMode": 0o444,
            },
        }
    )
    model.mounts.append(config)
    for claim in adapters.adapter_claims(spec):
        volume = adapters.claim_volume(claim)
        model.volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        model.mounts.append(
            {
                "name": volume,
                "mountPath": f"{adapters.ADAPTER_CLAIMS_DIR}/{claim}",
                "readOnly": True,
            }
        )
    command = [
        "python3",
        f"{SCRIPT_DIR}/{SCRIPT_FILE}",
        "--adapters",
        f"{adapters.ADAPTERS_DIR}/{adapters.DOWNLOADS_FILE}",
    ]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        *_compile_cache_folder_env(owner, spec),
    ]
    # The model's token is every hf:// adapter's default (huggingface_hub reads HF_TOKEN); an
    # adapter's own is passed by the variable its download item names. Those are optional: a
    # Secret missing fails its adapters' downloads (logged, retried), not the engine pod.
    if (ref := spec.model.hf_token_secret_ref) is not None:
        env.append(_secret_env("HF_TOKEN", ref))
    env += [_secret_env(adapters.token_env(r), r, optional=True) for r in adapters.token_refs(spec)]
    downloader = {
        "image": image,
        **_pull_policy(spec),
        "env": env,
        "resources": {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _restricted_container_security(),
        "volumeMounts": [*_download_mounts(), config],
    }
    model.init_containers.append({"name": "adapter-download", **downloader, "command": command})
    watch = ["--watch", str(ADAPTER_DOWNLOAD_INTERVAL_SECONDS)]
    return [{"name": "adapter-downloader", **downloader, "command": command + watch}]


def _pull_policy(spec: InferenceServiceSpec) -> dict[str, str]:
    policy = spec.engine.image_pull_policy
    return {"imagePullPolicy": policy} if policy else {}


def _engine_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    # A read-only root filesystem: everything that caches writes under /tmp (an emptyDir),
    # including the demo model the engine builds on first start.
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "KVFLEET_CACHE_DIR", "value": "/tmp/kvfleet"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {
            "name": "KVFLEET_COMPILE_CACHE_DIR",
            "value": COMPILE_CACHE_MOUNT if spec.model_cache is not None else COMPILE_CACHE_TMP,
        },
    ]
    if (ref := spec.api_key_secret_ref) is not None:
        # The engine reads its key from this variable: never on the command line, where the
        # node's process table would show it.
        env.append(
            {
                "name": "KVFLEET_API_KEY",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    user = [e.model_dump(by_alias=True, exclude_none=True) for e in spec.engine.env]
    overridden = {e["name"] for e in user}
    return [e for e in env if e["name"] not in overridden] + user


def _engine_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    r = spec.resources
    requests: dict[str, Any] = {"cpu": r.cpu, "memory": r.memory}
    # Memory limit = request: a node never overcommits the memory a model needs. No CPU limit:
    # throttling the scheduler loop costs latency for nothing.
    limits: dict[str, Any] = {"memory": r.memory}
    if r.gpus > 0:
        requests[r.gpu_resource_name] = str(r.gpus)
        limits[r.gpu_resource_name] = str(r.gpus)
    return {"requests": requests, "limits": limits}


def _scheduling(spec: InferenceServiceSpec) -> dict[str, Any]:
    s = spec.scheduling
    out: dict[str, Any] = {}
    if s.node_selector:
        out["nodeSelector"] = dict(s.node_selector)
    if s.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in s.tolerations]
    if s.affinity:
        out["affinity"] = s.affinity
    if s.priority_class_name:
        out["priorityClassName"] = s.priority_class_name
    if s.runtime_class_name:
        out["runtimeClassName"] = s.runtime_class_name
    return out


def engine_deployment(
    owner: Owner,
    spec: InferenceServiceSpec,
    config: OperatorConfig,
    deployment_replicas: int | None = None,
) -> dict[str, Any]:
    """deployment_replicas: its replicas as the reconciler applies them
    (spec.engine_deployment_replicas); None for the spec's own (spec.replicas_from_spec)."""
    e = spec.engine
    image = e.image or config.default_engine_image(spec)
    model = _model_wiring(owner, spec, image)
    beside = _adapter_wiring(owner, spec, image, model) if spec.adapters else []
    volumes = [{"name": "tmp", "emptyDir": {}}, *model.volumes]
    mounts = [
        {"name": "tmp", "mountPath": "/tmp"},
        *model.mounts,
        *_compile_cache_mounts(owner, spec),
    ]
    if spec.resources.gpus > 1:
        # The tensor-parallel workers of one pod (one per GPU) talk through NCCL, which falls back
        # to /dev/shm segments where GPUs lack peer access; the runtime's default is 64 MiB. The
        # tmpfs counts against the memory limit: the sizeLimit makes a full /dev/shm fail with
        # "No space left on device" in the engine's log rather than an OOM kill of the pod.
        volumes.append(
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shared_memory},
            }
        )
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": "engine",
        "image": image,
        **_pull_policy(spec),
        # With adapters, a shell adds those of the adapters ConfigMap to the arguments.
        "command": (
            ["/bin/sh", "-c", adapters.ENGINE_START_SCRIPT, "kvfleet-engine"]
            if spec.adapters
            else ["kvfleet-engine"]
        ),
        "args": engine_args(spec, model.path, port=ENGINE_PORT),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": _engine_env(spec),
        "resources": _engine_resources(spec),
        # The HTTP server starts once the weights are loaded: until then /health refuses
        # connections, and the startup probe waits up to startupTimeoutSeconds for it. Every
        # second: the pod is Ready (the kubelet runs the readiness probe at once) within a second
        # of the engine serving, where a request held at zero waits for it; the probe stops once
        # it succeeds.
        "startupProbe": _http_probe(
            "/health", period=1, timeout=1, failures=e.startup_timeout_seconds
        ),
        # /health turns 503 when the engine loop stops making progress: restart it.
        "livenessProbe": _http_probe("/health", period=10, timeout=5, failures=3),
        # /ready turns 503 while draining: leave the endpoints, keep the pod.
        "readinessProbe": _http_probe("/ready", period=5, timeout=3, failures=2),
        "lifecycle": _prestop(),
        "securityContext": _restricted_container_security(),
        "volumeMounts": mounts,
        # An engine that exits on an error (a GPU without fp8, weights that do not fit) leaves
        # its last log lines as the termination message, which the Degraded condition quotes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
    }
    if model.init_containers:
        # The script reaches the pod through a ConfigMap, whose changes do not restart pods:
        # its hash in the template does.
        script = model_download_script().encode()
        template_annotations[CONFIG_HASH_ANNOTATION] = hashlib.sha256(script).hexdigest()[:20]
    if spec.adapters and spec.api_key_secret_ref is not None:
        # The engines' adapter endpoints want the API key, which the operator does not hold:
        # an edit of the adapters reaches the engines by a rollout, each loading them at start.
        listing = json.dumps(adapters.config_data(spec), sort_keys=True).encode()
        template_annotations[ADAPTERS_HASH_ANNOTATION] = hashlib.sha256(listing).hexdigest()[:20]
    pod_spec: dict[str, Any] = {
        # The engine never talks to the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": _restricted_pod_security(),
        **_scheduling(spec),
        "containers": [container, *beside],
        "volumes": volumes,
    }
    if model.init_containers:
        pod_spec["initContainers"] = model.init_containers
    name = engine_name(owner.name)
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(owner, name, "engine"),
            "spec": {
                "replicas": (
                    replicas_from_spec(spec) if deployment_replicas is None else deployment_replicas
                ),
                "selector": {"matchLabels": selector_labels(owner.name, "engine")},
                # A new pod must be ready before an old one goes: capacity never dips, at the
                # price of one spare GPU slot during a rollout.
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                # Downloading and loading a model legitimately takes long: report a stuck
                # rollout only well after the startup probe would have given up.
                "progressDeadlineSeconds": e.startup_timeout_seconds + 600,
                "revisionHistoryLimit": 3,
                "template": {
                    "metadata": {
                        "labels": common_labels(owner.name, "engine"),
                        "annotations": template_annotations,
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def engine_service(owner: Owner) -> dict[str, Any]:
    name = engine_name(owner.name)
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, name, "engine"),
            "spec": {
                # Headless: the router balances over the pods itself, from the EndpointSlices.
                "clusterIP": "None",
                "selector": selector_labels(owner.name, "engine"),
                "ports": [
                    {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        }
    )


def router_deployment(
    owner: Owner, spec: InferenceServiceSpec, config: OperatorConfig
) -> dict[str, Any]:
    name = router_name(owner.name)
    selector = selector_labels(owner.name, "router")
    container = {
        "name": "router",
        "image": spec.routing.image or config.router_image,
        "command": ["kvfleet-router"],
        "args": router_args(
            port=ROUTER_PORT,
            engine_service=engine_name(owner.name),
            engine_port=ENGINE_PORT,
            namespace=owner.namespace,
            routing=spec.routing,
        ),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "readinessProbe": _http_probe("/health", period=5, timeout=3, failures=2),
        "livenessProbe": _http_probe("/health", period=10, timeout=5, failures=3),
        "lifecycle": _prestop(),
        "securityContext": _restricted_container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(owner, name, "router"),
            "spec": {
                "replicas": spec.routing.replicas,
                "selector": {"matchLabels": selector},
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                },
                "revisionHistoryLimit": 3,
                "template": {
                    "metadata": {"labels": common_labels(owner.name, "router")},
                    "spec": {
                        "serviceAccountName": name,
                        "enableServiceLinks": False,
                        # Streams in flight finish before the router exits; the engines behind
                        # it drain for as long.
                        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
                        "securityContext": _restricted_pod_security(),
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "kubernetes.io/hostname",
                                "whenUnsatisfiable": "ScheduleAnyway",
                                "labelSelector": {"matchLabels": selector},
                            }
                        ],
                        "containers": [container],
                        "volumes": [{"name": "tmp", "emptyDir": {}}],
                    },
                },
            },
        }
    )


def router_service(owner: Owner) -> dict[str, Any]:
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, owner.name, "router"),
            "spec": {
                "type": "ClusterIP",
                "selector": selector_labels(owner.name, "router"),
                "ports": [
                    {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
                ],
            },
        }
    )


def disruption_budget(owner: Owner, component: str, budget: DisruptionBudgetSpec) -> dict[str, Any]:
    """The PodDisruptionBudget of the engine or router pods (component "engine" or "router").

    maxUnavailable rather than minAvailable: the budget follows the replica count the autoscaler
    sets, so a single replica may still be evicted (and rescheduled) by a node drain, and a
    service scaled to zero has nothing to hold. Replica changes are not evictions: it never
    holds a rollout or a scale-down. Pods that are not ready (a model loading, a crash loop)
    serve nothing and may always be evicted, so a broken service cannot block a drain either.
    """
    return with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, f"{owner.name}-{component}", component),
            "spec": {
                "maxUnavailable": budget.max_unavailable,
                "selector": {"matchLabels": selector_labels(owner.name, component)},
                "unhealthyPodEvictionPolicy": "AlwaysAllow",
            },
        }
    )


def router_service_account(owner: Owner) -> dict[str, Any]:
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(owner, router_name(owner.name), "router"),
        }
    )


def router_role(owner: Owner) -> dict[str, Any]:
    return with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(owner, router_name(owner.name), "router"),
            "rules": as_manifest(ROUTER_RULES),
        }
    )


def router_role_binding(owner: Owner) -> dict[str, Any]:
    name = router_name(owner.name)
    return with_hash(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(owner, name, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        }
    )


def download_config_map(owner: Owner) -> dict[str, Any]:
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(owner, download_config_name(owner.name), "engine"),
            "data": {SCRIPT_FILE: model_download_script()},
        }
    )


def adapters_config_map(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The adapters of the spec, as the engine pods read them (adapters.py)."""
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(owner, adapters.adapters_config_name(owner.name), "engine"),
            "data": adapters.config_data(spec),
        }
    )


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    config: OperatorConfig,
    deployment_replicas: int | None = None,
) -> list[dict[str, Any]]:
    """All desired children, in creation order (what a pod needs exists before the pod);
    deployment_replicas: the engine Deployment's, as engine_deployment takes them."""
    children = []
    if spec.model.parsed_source.kind == "hf" or spec.adapters:
        children.append(download_config_map(owner))
    if spec.adapters:
        children.append(adapters_config_map(owner, spec))
    children += [
        router_service_account(owner),
        router_role(owner),
        router_role_binding(owner),
        engine_service(owner),
        disruption_budget(owner, "engine", spec.engine.disruption_budget),
        engine_deployment(owner, spec, config, deployment_replicas),
        disruption_budget(owner, "router", spec.routing.disruption_budget),
        router_deployment(owner, spec, config),
        router_service(owner),
    ]
    return children


def optional_children(owner: Owner) -> list[ChildRef]:
    """Children that only some specs have: removed when the spec stops asking for them."""
    return [
        ChildRef("v1", "ConfigMap", "configmaps", download_config_name(owner.name)),
        ChildRef("v1", "ConfigMap", "configmaps", adapters.adapters_config_name(owner.name)),
    ]
