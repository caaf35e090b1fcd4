"""The InferenceService spec as pydantic models, and its validation. Pure: no I/O.

``crds/inferenceservices.kvfleet.dev.yaml`` is the source of truth for the API; these models
mirror it field for field (same names, defaults, ranges and enums). The API server enforces the
schema and the CEL rules before an object is stored, but the operator validates again: an API
server older than CEL support, an emulator, or a CRD installed without validation must not make
the operator act on a spec the CRD would reject. Each CEL rule has an equivalent check here that
fails with the same message; tests/operator/test_crd_schema.py holds the two to each other.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic.alias_generators import to_camel

from kvfleet.operator.engine_flags import TOOL_CALL_PARSERS, ExtraArgsError, given_flags
from kvfleet.operator.scaling_policy import bound_replicas

# Served name of the engine's built-in demo model (kvfleet.engine.default_model.DEFAULT_MODEL_NAME;
# not imported, because importing the engine package pulls in torch, which the operator image
# does not have).
DEMO_MODEL_NAME = "smollm2-135m-instruct"

# Children are named "<name>-engine" etc. and the router Service is "<name>": a DNS-1035 label
# of at most 63 characters, so the longest suffix ("-engine", "-router": 7) leaves 56.
MAX_NAME_LENGTH = 56

# Messages shared with the CRD's CEL rules (x-kubernetes-validations); the test compares them.
MSG_NAME_FORMAT = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
    "letter): it names the router Service"
)
MSG_NAME_LENGTH = "metadata.name must be at most 56 characters: children append '-engine'"
MSG_MIN_MAX = "minReplicas must be less than or equal to maxReplicas"
MSG_REPLICAS_BOUNDS = (
    "with autoscaling.mode builtin, replicas must lie within [minReplicas, maxReplicas]"
)
MSG_EXTERNAL_REPLICAS = (
    "autoscaling.mode external needs replicas: HPA and KEDA read and write it through /scale"
)
# A transition rule (the API server checks it on updates, /scale included): parse_spec sees one
# object, so the reconciler, which remembers the previous one, says it with a Warning Event.
MSG_SCALE_BUILTIN = (
    "with autoscaling.mode builtin the autoscaler owns the replica count: replicas (kubectl "
    "scale) cannot be set or changed; change autoscaling.minReplicas and maxReplicas, or use "
    "autoscaling.mode external"
)
MSG_TP_GPUS = "tensorParallelSize > 1 needs resources.gpus equal to it (one GPU per shard)"
MSG_MODEL_CACHE_HF = (
    "modelCache is only used to download hf:// models, and the adapters of a service that has some"
)
MSG_HF_TOKEN_HF = "hfTokenSecretRef is only used with hf:// sources"
MSG_NO_DOTDOT = "source must not contain '..' path segments"
MSG_ADAPTER_RANK = "an adapter's rank must not exceed engine.maxLoraRank"
MSG_CPU_LORAS = "maxCpuLoras must be at least maxLoras: every adapter on the GPU has a host copy"
MSG_POOLING_TTFT = (
    "an embedding engine (engine.runner pooling) has no time to first token: "
    "autoscaling.latencyTarget.metric must be queueTime"
)
# The engine flags the operator sets itself, from the spec's fields (probes, routing, auth and the
# pod's grace period depend on them), and the help switch, which would make the engine exit at
# once. extraArgs may set none of them, nor an abbreviation: the CRD's rule refuses every prefix,
# and the operator parses extraArgs as the engine does (engine_flags.py).
MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "--device",
    "--dtype",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--gpu-memory-utilization",
    "--max-model-len",
    "--max-waiting-requests",
    "--shutdown-timeout",
    "--tensor-parallel-size",
    "--quantization",
    "--kv-cache-dtype",
    "--tool-call-parser",
    "--enable-lora",
    "--lora-modules",
    "--max-loras",
    "--max-lora-rank",
    "--max-cpu-loras",
    "--enable-runtime-lora-updating",
    "--runner",
    "--cpu-kv-cache-bytes",
    "-h",
    "--help",
)
MSG_CPU_KV_CACHE = (
    "engine.cpuKvCacheBytes needs enablePrefixCaching: the host tier keeps prefix-cache blocks"
)
MSG_MANAGED_FLAGS = (
    "extraArgs must not set, or abbreviate, a flag the operator manages: "
    + ", ".join(MANAGED_FLAGS)
)


def _prefix_alternation(words: list[str]) -> str:
    # A trie as a regex: "ab|ac" becomes "a(b|c)", each level optional, so it matches every
    # prefix of every word.
    parts = []
    for head in sorted({w[0] for w in words}):
        tails = [w[1:] for w in words if w[0] == head and len(w) > 1]
        parts.append(head + (f"({_prefix_alternation(tails)})?" if tails else ""))
    return "|".join(parts)


def managed_flag_pattern() -> str:
    """RE2, for the CRD's CEL rule: an argument whose option name (the part before any '=') is a
    managed flag or a prefix of one; "-" alone excepted (argparse reads it as a positional)."""
    return f"^-({_prefix_alternation([f[1:] for f in MANAGED_FLAGS])})(=|$)"


# \Z: Python's $ also matches before a final newline, RE2's does not.
MANAGED_FLAG_RE = re.compile(managed_flag_pattern().replace("(=|$)", r"(=|\Z)"))
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
HF_SOURCE_RE = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*)"
    r"(@(?P<revision>[-A-Za-z0-9_./]+))?$"
)
PVC_SOURCE_RE = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9.]*[a-z0-9])?)(?P<path>/\S*)?$")
PATH_SOURCE_RE = re.compile(r"^/\S*$")
DOTDOT_RE = re.compile(r"(^|/)[.][.](/|$)")
# The pattern of the CRD's spec.model.source: empty (demo model), hf://, pvc:// or a path.
SOURCE_PATTERN = (
    r"^$|^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[-A-Za-z0-9_./]+)?$"
    r"|^pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/\S*)?$|^/\S*$"
)
# An adapter's source: as a model's, but never empty.
ADAPTER_SOURCE_PATTERN = SOURCE_PATTERN.removeprefix("^$|")
# An adapter's name, the "model" of its requests: an OpenAI model name (no whitespace), which
# is also an --lora-modules NAME=PATH word and a Prometheus label value, so no '=' either.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$"
# Adapters one service registers: every engine holds them all on disk, the operator loads each
# into each engine pod, and their --lora-modules words make the command line.
MAX_ADAPTERS = 128
# The largest adapter rank an engine can be asked to hold (its GPU slots are sized by it): the
# engine's own bound (--max-lora-rank, the LoRA kernels' tile height), which a test holds equal.
MAX_LORA_RANK = 256
# Kubernetes resource.Quantity, unsigned.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
    r"|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
HTTP_TOKEN_PATTERN = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
EXTENDED_RESOURCE_PATTERN = (
    r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
# A PodDisruptionBudget's maxUnavailable as a percentage of the replicas, 1% to 100%.
PERCENT_PATTERN = r"^([1-9][0-9]?|100)%$"


def _int_to_str(value: Any) -> Any:
    # int-or-string in the CRD: 4 and "4" are the same quantity.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Quantity = Annotated[
    str, BeforeValidator(_int_to_str), StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)
]
DnsSubdomain = Annotated[
    str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
]


class _Model(BaseModel):
    # forbid: the API server prunes unknown fields, so an unknown field here is a typo that
    # reached the operator some other way; reporting it beats silently ignoring it.
    model_config = ConfigDict(alias_generator=to_camel, extra="forbid", frozen=True)


SecretKey = Annotated[str, StringConstraints(min_length=1, max_length=253)]


class HFTokenSecretRef(_Model):
    name: DnsSubdomain
    key: SecretKey = "token"


class APIKeySecretRef(_Model):
    name: DnsSubdomain
    key: SecretKey = "api-key"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from. kind "demo": the engine's built-in default model."""

    kind: Literal["demo", "hf", "pvc", "path"]
    repo: str = ""  # hf: "org/name"
    revision: str = ""  # hf: branch, tag or commit; "main" when not given
    claim: str = ""  # pvc: claim name
    path: str = ""  # pvc: path inside the claim ("" = its root); path: the absolute path


def parse_source(source: str) -> ModelSource:
    if not source:
        return ModelSource(kind="demo")
    if m := HF_SOURCE_RE.match(source):
        return ModelSource(kind="hf", repo=m["repo"], revision=m["revision"] or "main")
    if m := PVC_SOURCE_RE.match(source):
        return ModelSource(kind="pvc", claim=m["claim"], path=(m["path"] or "").strip("/"))
    if PATH_SOURCE_RE.match(source):
        return ModelSource(kind="path", path=source)
    # Unreachable for a validated spec: ModelSpec.source carries the same pattern.
    raise ValueError(f"unsupported model source {source!r}")


class ModelSpec(_Model):
    source: Annotated[str, StringConstraints(max_length=512, pattern=SOURCE_PATTERN)] = ""
    served_name: (
        Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^\S+$")] | None
    ) = None
    hf_token_secret_ref: HFTokenSecretRef | None = None
    # Parsed once, with the spec; private, so it is neither a CRD field nor in model_dump.
    _parsed_source: ModelSource = PrivateAttr()

    @model_validator(mode="after")
    def _cel(self) -> ModelSpec:
        if DOTDOT_RE.search(self.source):
            raise ValueError(MSG_NO_DOTDOT)
        self._parsed_source = parse_source(self.source)
        if self.hf_token_secret_ref is not None and self._parsed_source.kind != "hf":
            raise ValueError(MSG_HF_TOKEN_HF)
        return self

    @property
    def parsed_source(self) -> ModelSource:
        return self._parsed_source


class EnvVar(_Model):
    name: Annotated[str, StringConstraints(min_length=1, max_length=253)]
    value: str | None = None
    # Passed through to the pod as is; the API server validates it there.
    value_from: dict[str, Any] | None = None


class DisruptionBudgetSpec(_Model):
    """The PodDisruptionBudget of the engine or router pods. maxUnavailable, never 0: a budget
    that allows no eviction would block every node drain while the service runs."""

    max_unavailable: (
        Annotated[int, Field(ge=1, le=1000, strict=True)]
        | Annotated[str, StringConstraints(max_length=4, pattern=PERCENT_PATTERN)]
    ) = 1


class EngineSpec(_Model):
    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    # None: the engine's default for its GPU (1024 on one of 70 GiB or more, else 256).
    max_num_seqs: int | None = Field(default=None, ge=1, le=65536)
    # None: the engine's default for its device (8192 on a GPU, 512 on the CPU).
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    block_size: Literal[16] = 16
    enable_prefix_caching: bool = True
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # None: as the checkpoint is (an fp8 checkpoint's quantization_config is read).
    quantization: Literal["fp8"] | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    # None: the engine picks the family from the chat template.
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # type: ignore[valid-type]
    # None: the engine chooses (pooling for an embedding checkpoint, else generate).
    runner: Literal["generate", "pooling"] | None = None
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    max_waiting_requests: Annotated[int, Field(ge=1)] | None = None
    shutdown_timeout_seconds: int = Field(default=30, ge=0, le=3600)
    # LoRA: used when spec.adapters is not empty.
    max_loras: int = Field(default=4, ge=1, le=256)
    max_cpu_loras: int = Field(default=16, ge=1, le=1024)
    max_lora_rank: int = Field(default=16, ge=1, le=MAX_LORA_RANK)
    # Host memory for the KV cache's host tier (--cpu-kv-cache-bytes); "0" turns it off. None:
    # sized from resources.memory (operator/cpu_kv_cache.py).
    cpu_kv_cache_bytes: Quantity | None = None
    startup_timeout_seconds: int = Field(default=1800, ge=60, le=86400)
    extra_args: list[Annotated[str, StringConstraints(max_length=256)]] = Field(
        default_factory=list, max_length=64
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)

    @model_validator(mode="after")
    def _cel(self) -> EngineSpec:
        if bad := [arg for arg in self.extra_args if MANAGED_FLAG_RE.match(arg)]:
            raise ValueError(f"{MSG_MANAGED_FLAGS} (got {', '.join(map(repr, bad))})")
        try:
            given_flags(list(self.extra_args))
        except ExtraArgsError as e:
            raise ValueError(f"extraArgs are not kvfleet-engine serve arguments: {e}") from None
        names = [e.name for e in self.env]
        if len(names) != len(set(names)):
            # The CRD makes env a map keyed by name, which rejects duplicates.
            raise ValueError("env names must be unique")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(MSG_CPU_LORAS)
        if not self.enable_prefix_caching and self.cpu_kv_cache_bytes not in (None, "0"):
            raise ValueError(MSG_CPU_KV_CACHE)
        return self


class ResourcesSpec(_Model):
    gpus: int = Field(default=1, ge=0, le=64)
    gpu_resource_name: Annotated[
        str, StringConstraints(max_length=253, pattern=EXTENDED_RESOURCE_PATTERN)
    ] = "nvidia.com/gpu"
    cpu: Quantity = "4"
    memory: Quantity = "32Gi"
    shared_memory: Quantity = "2Gi"


class Toleration(_Model):
    key: Annotated[str, StringConstraints(max_length=316)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, StringConstraints(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    # A core/v1 Affinity, passed through; the API server validates it on the Deployment.
    affinity: dict[str, Any] | None = None
    priority_class_name: DnsSubdomain | None = None
    runtime_class_name: DnsSubdomain | None = None


class LatencyTarget(_Model):
    """A latency the autoscaler holds the service to, beside queue depth and KV-cache usage."""

    # ttft: arrival to first token; queueTime: arrival to first scheduling.
    metric: Literal["ttft", "queueTime"] = "ttft"
    quantile: float = Field(default=0.9, ge=0.5, le=0.99)
    target_seconds: float = Field(gt=0.0, le=3600.0)


class AutoscalingSpec(_Model):
    mode: Literal["builtin", "external"] = "builtin"
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=1, ge=1, le=1000)
    target_queue_depth: float = Field(default=4.0, gt=0.0, le=10000.0)
    target_kv_cache_usage: float = Field(default=0.8, gt=0.0, le=1.0, alias="targetKVCacheUsage")
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86400)
    scale_to_zero_delay_seconds: int = Field(default=600, ge=0, le=86400)
    latency_target: LatencyTarget | None = None
    scale_ahead: bool = True

    @model_validator(mode="after")
    def _cel(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MSG_MIN_MAX)
        return self


class RoutingSpec(_Model):
    replicas: int = Field(default=1, ge=1, le=100)
    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    session_header: Annotated[
        str, StringConstraints(min_length=1, max_length=128, pattern=HTTP_TOKEN_PATTERN)
    ] = "x-session-id"
    use_user_field: bool = True
    prefix_affinity: bool = True
    prefix_length: int = Field(default=256, ge=1, le=65536)
    load_factor: float = Field(default=1.25, ge=1.0, le=10.0)
    hold_timeout_seconds: int = Field(default=120, ge=0, le=3600)
    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)


class AdapterSpec(_Model):
    """A LoRA adapter of the base model, served under its own name."""

    name: Annotated[
        str, StringConstraints(min_length=1, max_length=128, pattern=ADAPTER_NAME_PATTERN)
    ]
    source: Annotated[str, StringConstraints(max_length=512, pattern=ADAPTER_SOURCE_PATTERN)]
    # Checked against engine.maxLoraRank; the engine reads the true rank from the adapter.
    rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK)
    # hf:// only; without it the adapter downloader uses spec.model.hfTokenSecretRef's token.
    hf_token_secret_ref: HFTokenSecretRef | None = None
    _parsed_source: ModelSource = PrivateAttr()

    @model_validator(mode="after")
    def _cel(self) -> AdapterSpec:
        if DOTDOT_RE.search(self.source):
            raise ValueError(MSG_NO_DOTDOT)
        self._parsed_source = parse_source(self.source)
        if self.hf_token_secret_ref is not None and self._parsed_source.kind != "hf":
            raise ValueError(MSG_HF_TOKEN_HF)
        return self

    @property
    def parsed_source(self) -> ModelSource:
        return self._parsed_source


class ModelCacheSpec(_Model):
    claim_name: DnsSubdomain


class InferenceServiceSpec(_Model):
    model: ModelSpec = Field(default_factory=ModelSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    replicas: Annotated[int, Field(ge=0, le=1000)] | None = None
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    api_key_secret_ref: APIKeySecretRef | None = None
    model_cache: ModelCacheSpec | None = None
    adapters: list[AdapterSpec] = Field(default_factory=list, max_length=MAX_ADAPTERS)

    @model_validator(mode="after")
    def _cel(self) -> InferenceServiceSpec:
        a = self.autoscaling
        if (
            self.replicas is not None
            and a.mode == "builtin"
            and not a.min_replicas <= self.replicas <= a.max_replicas
        ):
            raise ValueError(MSG_REPLICAS_BOUNDS)
        if a.mode == "external" and self.replicas is None:
            raise ValueError(MSG_EXTERNAL_REPLICAS)
        tp = self.engine.tensor_parallel_size
        if tp > 1 and tp != self.resources.gpus:
            raise ValueError(MSG_TP_GPUS)
        if (
            self.model_cache is not None
            and self.model.parsed_source.kind != "hf"
            and not self.adapters
        ):
            raise ValueError(MSG_MODEL_CACHE_HF)
        if any(a.rank is not None and a.rank > self.engine.max_lora_rank for a in self.adapters):
            raise ValueError(MSG_ADAPTER_RANK)
        target = a.latency_target
        if self.engine.runner == "pooling" and target is not None and target.metric == "ttft":
            raise ValueError(MSG_POOLING_TTFT)
        names = [a.name for a in self.adapters]
        if len(names) != len(set(names)):
            # The CRD makes adapters a map keyed by name, which rejects duplicates.
            raise ValueError("adapter names must be unique")
        if (base := served_model_name(self)) in names:
            raise ValueError(
                f"adapter name {base!r} is the base model's served name: requests could not "
                "tell them apart"
            )
        return self


# GPU Feature Discovery's node labels: the product name, and the compute capability.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_MAJOR_LABEL = "nvidia.com/gpu.compute.major"
GPU_MINOR_LABEL = "nvidia.com/gpu.compute.minor"
# Words of a GFD product name (NVIDIA-A100-SXM4-80GB, Tesla-T4, NVIDIA-RTX-A6000) naming a GPU
# older than Ada (compute capability < 8.9): Ampere's A-series, Volta, Turing, Pascal and before.
# A name this does not recognise is taken as able: the engine itself refuses at start-up.
_PRE_ADA_WORD = re.compile(
    r"^(QUADRO|A\d{1,4}[A-Z]?|GV100|V100[A-Z]?|T4G?|T\d{3,4}|P\d{1,3}|K\d{1,3}|M\d{2})$"
)
_PRE_ADA_RTX = re.compile(r"^[23]\d{3}(TI)?$")


def gpu_product_pre_ada(product: str) -> bool:
    """Whether a GFD product label names a GPU without fp8 (compute capability < 8.9)."""
    words = product.upper().replace("_", "-").split("-")
    if "ADA" in words:
        return False  # "RTX 6000 Ada Generation", not Ampere's RTX A6000
    after_rtx = [w for prev, w in itertools.pairwise(words) if prev == "RTX"]
    return any(_PRE_ADA_WORD.match(w) for w in words) or any(
        _PRE_ADA_RTX.match(w) for w in after_rtx
    )


def _pinned_products(scheduling: SchedulingSpec) -> list[list[str]]:
    """The GPU products each way of scheduling the pods allows, as the spec pins them: the
    nodeSelector's product (all ways), and each required node-affinity term's `In` values for
    the product label. Empty: nothing pins a product (any term without one allows any GPU)."""
    pinned = scheduling.node_selector.get(GPU_PRODUCT_LABEL)
    required = _get_path(
        scheduling.affinity,
        "nodeAffinity",
        "requiredDuringSchedulingIgnoredDuringExecution",
        "nodeSelectorTerms",
    )
    terms: list[list[str]] = []
    for term in required if isinstance(required, list) else []:
        values: list[str] | None = None
        for expr in (term or {}).get("matchExpressions") or []:
            if expr.get("key") == GPU_PRODUCT_LABEL and expr.get("operator") == "In":
                values = [str(v) for v in expr.get("values") or []]
        if values is None:
            if pinned is None:
                return []  # this term allows any product
            values = [pinned]
        elif pinned is not None:
            values = [v for v in values if v == pinned]
        terms.append(values)
    if not terms and pinned is not None:
        terms = [[pinned]]
    return terms


def _get_path(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def fp8_gpu_problem(spec: InferenceServiceSpec) -> str | None:
    """Why the spec's fp8 (quantization or kvCacheDtype) cannot run where it schedules the
    engine: a GPU pinned (by nodeSelector or required node affinity) to products or a compute
    capability older than 8.9. None when fine, unknown, or on the CPU."""
    e = spec.engine
    asked = [
        f"{name} {value}"
        for name, value, on in (
            ("quantization", e.quantization, e.quantization is not None),
            ("kvCacheDtype", e.kv_cache_dtype, e.kv_cache_dtype != "auto"),
        )
        if on
    ]
    if not asked or spec.resources.gpus == 0:
        return None
    where = None
    selector = spec.scheduling.node_selector
    major, minor = selector.get(GPU_MAJOR_LABEL), selector.get(GPU_MINOR_LABEL)
    if major is not None and major.isdigit():
        minor_n = int(minor) if minor is not None and minor.isdigit() else 9
        if (int(major), minor_n) < (8, 9):
            where = f"nodeSelector {GPU_MAJOR_LABEL}={major}" + (
                f", {GPU_MINOR_LABEL}={minor}" if minor is not None else ""
            )
    terms = _pinned_products(spec.scheduling)
    if where is None and terms and all(all(gpu_product_pre_ada(p) for p in t) for t in terms):
        products = sorted({p for t in terms for p in t})
        where = f"{GPU_PRODUCT_LABEL} {', '.join(products) or '(none)'}"
    if where is None:
        return None
    return (
        f"spec.engine {' and '.join(asked)} needs a GPU of compute capability 8.9+ (Ada, Hopper "
        f"or newer), but the spec schedules the engine only onto older GPUs ({where}): set "
        "quantization and kvCacheDtype back to their defaults, or schedule onto Ada/Hopper GPUs"
    )


def fp8_cpu_warning(spec: InferenceServiceSpec) -> str | None:
    """fp8 on a CPU engine runs, through the engine's reference path, slowly: worth a Warning
    Event, not a refusal (vLLM and KubeAI users expect the flag honoured)."""
    e = spec.engine
    if spec.resources.gpus > 0 or (e.quantization is None and e.kv_cache_dtype == "auto"):
        return None
    return (
        "spec.engine asks for fp8 (quantization or kvCacheDtype) with resources.gpus 0: the CPU "
        "engine emulates fp8 in its reference path, which saves memory but runs slower than "
        "the model dtype; fp8 pays off on GPUs of compute capability 8.9+"
    )


def served_model_name(spec: InferenceServiceSpec) -> str:
    """The name clients put in "model": the one given, else what vLLM would call it."""
    if spec.model.served_name:
        return spec.model.served_name
    src = spec.model.parsed_source
    match src.kind:
        case "demo":
            return DEMO_MODEL_NAME
        case "hf":
            return src.repo
        case "pvc":
            return src.path.rsplit("/", 1)[-1] or src.claim
        case _:
            return src.path.rstrip("/").rsplit("/", 1)[-1] or src.path


def replicas_from_spec(spec: InferenceServiceSpec) -> int:
    """The engine replicas the spec alone gives: the engine Deployment's replicas in external
    mode, and in builtin mode until the autoscaler's first decision.

    spec.replicas wins when set: in external mode HPA/KEDA write it through /scale (the CRD
    requires it there), and in builtin mode the CRD keeps it within [minReplicas, maxReplicas].
    Unset, the service starts with at least one replica even when minReplicas is 0, so a new
    endpoint answers at once; scaling to zero is the autoscaler's decision, after
    scaleToZeroDelaySeconds of idleness.
    """
    if spec.replicas is not None:
        return spec.replicas
    return max(spec.autoscaling.min_replicas, 1)


def engine_deployment_replicas(spec: InferenceServiceSpec, desired: int | None) -> int:
    """The engine Deployment's replicas, as the reconciler applies them, given the autoscaler's
    last decision (status.desiredReplicas, None before the first).

    external: spec.replicas, which HPA/KEDA drive through /scale. builtin: the operator owns the
    count, so spec.replicas only seeds it; bounds changed since the decision apply at once.
    """
    a = spec.autoscaling
    if a.mode == "external" or desired is None:
        return replicas_from_spec(spec)
    return bound_replicas(desired, a.min_replicas, a.max_replicas)


class SpecError(ValueError):
    """A spec the operator will not act on; the message is shown in the Degraded condition."""


def _describe(err: Any) -> str:
    loc = ".".join(str(p) for p in err["loc"] if p != "__root__")
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"spec.{loc}: {msg}" if loc else f"spec: {msg}"


def parse_spec(name: str, raw: Any) -> InferenceServiceSpec:
    """Validate an InferenceService (its name and spec) as the CRD and the engine require."""
    problems: list[str] = []
    if not NAME_RE.match(name):
        problems.append(MSG_NAME_FORMAT)
    if len(name) > MAX_NAME_LENGTH:
        problems.append(MSG_NAME_LENGTH)
    spec: InferenceServiceSpec | None = None
    try:
        spec = InferenceServiceSpec.model_validate(raw if raw is not None else {})
    except ValidationError as e:
        problems.extend(_describe(err) for err in e.errors(include_url=False))
    if problems or spec is None:
        raise SpecError("; ".join(problems))
    return spec
