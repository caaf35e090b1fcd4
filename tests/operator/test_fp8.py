"""spec.engine.quantization and spec.engine.kvCacheDtype (issue 21 item 3): the engine flags they
set, the GPUs they need (a spec pinned to pre-Ada GPUs is not applied: Degraded/FP8Unsupported
with a Warning Event), fp8 on a CPU engine (applied, one Warning Event), and an engine that exits
on a GPU without fp8, whose termination message the Degraded condition quotes."""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

import pytest

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.resources import Owner, build_children
from kvfleet.operator.spec import (
    MANAGED_FLAGS,
    SpecError,
    fp8_cpu_warning,
    fp8_gpu_problem,
    gpu_product_pre_ada,
    parse_spec,
)
from kvfleet.operator.status import Observed, compute_status
from tests.support.kmock import (
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    LLAMA,
    NS,
    PODS,
    api,
    child_names,
    children_of,
    condition,
    create,
    eventually,
    operator,
    settled,
    url,
)

OWNER = Owner(name="llm", namespace="team-a", uid="u")
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")
FP8 = {"quantization": "fp8", "kvCacheDtype": "fp8"}
NOW = datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC)


def engine_container(raw: dict[str, Any]) -> dict[str, Any]:
    children = build_children(OWNER, parse_spec("llm", raw), CONFIG)
    deploy = next(
        c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "llm-engine"
    )
    return deploy["spec"]["template"]["spec"]["containers"][0]


def test_the_fields_become_engine_flags_and_extra_args_cannot_set_them() -> None:
    args = engine_container({"engine": FP8})["args"]
    assert args[args.index("--quantization") + 1] == "fp8"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    plain = engine_container({})["args"]
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain
    args = engine_container({"engine": {"kvCacheDtype": "fp8_e4m3"}})["args"]
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    assert {"--quantization", "--kv-cache-dtype"} <= set(MANAGED_FLAGS)
    for extra in (["--quantization", "fp8"], ["--kv-cache-dtype=fp8"], ["--quant", "fp8"]):
        with pytest.raises(SpecError, match="a flag the operator manages"):
            parse_spec("llm", {"engine": {"extraArgs": extra}})
    for bad in ({"quantization": "int4"}, {"kvCacheDtype": "fp16"}):
        with pytest.raises(SpecError, match=next(iter(bad))):
            parse_spec("llm", {"engine": bad})


def test_the_engine_leaves_its_last_log_lines_as_termination_message() -> None:
    assert engine_container({})["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize(
    ("product", "pre_ada"),
    [
        ("NVIDIA-A100-SXM4-80GB", True),
        ("NVIDIA-A10G", True),
        ("Tesla-V100-SXM2-16GB", True),
        ("Tesla-T4", True),
        ("NVIDIA-RTX-A6000", True),
        ("NVIDIA-GeForce-RTX-3090", True),
        ("NVIDIA-H100-80GB-HBM3", False),
        ("NVIDIA-H200", False),
        ("NVIDIA-L4", False),
        ("NVIDIA-L40S", False),
        ("NVIDIA-RTX-6000-Ada-Generation", False),
        ("NVIDIA-GeForce-RTX-4090", False),
        ("NVIDIA-GH200-480GB", False),
        ("some-future-gpu", False),
    ],
)
def test_gpu_products(product: str, pre_ada: bool) -> None:
    assert gpu_product_pre_ada(product) is pre_ada


def _affinity(*terms: list[str]) -> dict[str, Any]:
    expr = [
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": t}]}
        for t in terms
    ]
    required = {"nodeSelectorTerms": expr}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}


MAJOR, MINOR = "nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor"


@pytest.mark.parametrize(
    ("scheduling", "refused"),
    [
        ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}}, True),
        ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}}, False),
        ({"nodeSelector": {MAJOR: "8"}}, False),  # 8.9 is Ada
        ({"nodeSelector": {MAJOR: "8", MINOR: "0"}}, True),
        ({"nodeSelector": {MAJOR: "7"}}, True),
        ({"affinity": _affinity(["NVIDIA-A100-SXM4-80GB", "Tesla-T4"])}, True),
        ({"affinity": _affinity(["NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3"])}, False),
        ({"affinity": _affinity(["Tesla-T4"], ["NVIDIA-L40S"])}, False),
        ({}, False),  # nothing pinned: the engine checks at start-up
    ],
)
def test_fp8_on_pinned_gpus(scheduling: dict[str, Any], refused: bool) -> None:
    spec = parse_spec("llm", {"engine": FP8, "scheduling": scheduling})
    problem = fp8_gpu_problem(spec)
    assert (problem is not None) is refused, problem
    if problem is not None:
        assert "compute capability 8.9+" in problem
        assert "quantization fp8 and kvCacheDtype fp8" in problem
    # Without fp8 nothing is refused.
    assert fp8_gpu_problem(parse_spec("llm", {"scheduling": scheduling})) is None


def test_fp8_on_the_cpu_is_a_warning_not_a_refusal() -> None:
    spec = parse_spec("llm", {"engine": {"kvCacheDtype": "fp8"}, "resources": {"gpus": 0}})
    assert fp8_gpu_problem(spec) is None
    assert "resources.gpus 0" in (fp8_cpu_warning(spec) or "")
    assert fp8_cpu_warning(parse_spec("llm", {"resources": {"gpus": 0}})) is None
    assert fp8_cpu_warning(parse_spec("llm", {"engine": FP8})) is None


def _crashing_pod(name: str, labels: dict[str, str], message: str) -> dict[str, Any]:
    terminated = {"exitCode": 1, "reason": "Error", "message": message}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels},
        "status": {
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "registry/engine:1",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": terminated},
                }
            ]
        },
    }


REASON = (
    "ValueError: quantization='fp8' needs a GPU of compute capability 8.9+; this GPU "
    "(NVIDIA A100-SXM4-80GB) is sm_80"
)


def test_a_crash_loop_quotes_the_last_line_of_the_termination_message() -> None:
    log_tail = f"INFO loading weights\nTraceback (most recent call last):\n  ...\n{REASON}\n\n"
    pod = _crashing_pod("llm-engine-1", {"kvfleet.dev/component": "engine"}, log_tail)
    status = compute_status(Observed(generation=1, selector="s", previous={}, pods=[pod]), NOW)
    degraded = status["conditions"][2]
    assert degraded["reason"] == "CrashLoopBackOff"
    assert degraded["message"].endswith(f"(last exit code 1 (Error): {REASON})")
    record = json.dumps({"level": "ERROR", "logger": "kvfleet.engine.cli", "message": REASON})
    pod = _crashing_pod("llm-engine-1", {}, f'{{"level": "INFO"}}\n{record}\n')
    status = compute_status(Observed(generation=1, selector="s", previous={}, pods=[pod]), NOW)
    assert status["conditions"][2]["message"].endswith(f"(Error): {REASON})")
    pod = _crashing_pod("llm-engine-1", {}, "x" * 5000)
    status = compute_status(Observed(generation=1, selector="s", previous={}, pods=[pod]), NOW)
    assert len(status["conditions"][2]["message"]) < 500


def _warnings(k, reason: str) -> list[dict[str, Any]]:
    return [e for e in k.every(EVENTS) if e["reason"] == reason and e["type"] == "Warning"]


def _degraded(k, name: str) -> dict[str, Any]:
    cond = condition(k.live(ISVCS, NS, name), "Degraded")
    return cond if cond.get("status") == "True" else {}


@pytest.mark.asyncio
async def test_a_service_pinned_to_pre_ada_gpus_is_degraded_and_not_applied(cluster):
    k = cluster
    pinned = copy.deepcopy(LLAMA)
    pinned["spec"].setdefault("engine", {}).update(FP8)
    pinned["spec"].setdefault("scheduling", {})["nodeSelector"] = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"
    }
    async with operator(k):
        await create(k, pinned, "pinned")
        cond = await eventually(lambda: _degraded(k, "pinned"))
        assert cond["reason"] == "FP8Unsupported"
        assert "NVIDIA-A100-SXM4-80GB" in cond["message"]
        await eventually(lambda: _warnings(k, "FP8Unsupported"))
        assert children_of(k, "pinned") == {}

        # Moved to H100s, it is applied, with the flags.
        selector = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        await api(
            k, "patch", url(ISVCS, "pinned"), {"spec": {"scheduling": {"nodeSelector": selector}}}
        )
        deploy = await eventually(lambda: k.live(DEPLOYMENTS, NS, "pinned-engine"))
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--quantization" in args and "--kv-cache-dtype" in args
        await settled(k)


@pytest.mark.asyncio
async def test_fp8_on_a_cpu_engine_warns_once_and_a_crash_is_quoted(cluster):
    k = cluster
    demo = copy.deepcopy(DEMO)
    demo["spec"].setdefault("engine", {})["kvCacheDtype"] = "fp8"
    async with operator(k):
        await create(k, demo, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await settled(k)
        [event] = await eventually(lambda: _warnings(k, "FP8OnCPU"))
        assert "reference path" in event["message"]

        # An engine that exits at start-up: the Degraded message quotes its reason.
        template = children_of(k, "demo")["Deployment/demo-engine"]["spec"]["template"]
        pod = _crashing_pod("demo-engine-1", template["metadata"]["labels"], f"INFO\n{REASON}\n")
        await api(k, "post", url(PODS), pod)
        cond = await eventually(lambda: _degraded(k, "demo"))
        assert cond["reason"] == "CrashLoopBackOff" and REASON in cond["message"]
        await settled(k)
        # The reconciles since did not repeat the warning.
        assert len(_warnings(k, "FP8OnCPU")) == 1
