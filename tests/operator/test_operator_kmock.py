"""The operator under the real kopf runtime against kmock (tests/support/kmock.py), a Kubernetes
API emulator that counts the operator's requests and writes."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.rbac import NAMESPACED_OPERATOR_RULES
from tests.support.kmock import (
    CONFIGMAPS,
    DEMO,
    DEPLOYMENTS,
    EVENTS,
    ISVCS,
    LLAMA,
    LLAMA_CHILDREN,
    NS,
    PODS,
    QWEN_TP2,
    SERVICES,
    APIServer,
    api,
    assert_rbac_covers,
    by_operator,
    child_names,
    children_of,
    condition,
    create,
    eventually,
    operator,
    reconciled_after,
    settled,
    url,
    writes,
)

pytestmark = pytest.mark.asyncio


async def mark_ready(k: APIServer, name: str, replicas: int) -> None:
    """Play the Deployment controller: all replicas of the current generation ready."""
    deploy = k.live(DEPLOYMENTS, NS, name)
    assert deploy is not None
    status = {
        "observedGeneration": deploy["metadata"]["generation"],
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
        "conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ],
    }
    await api(k, "patch", url(DEPLOYMENTS, name, "status"), {"status": status})


async def test_creating_an_inference_service_creates_its_owned_children(cluster):
    k = cluster
    async with operator(k):
        llama = await create(k, LLAMA, "llama")
        demo = await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await eventually(lambda: condition(k.live(ISVCS, NS, "llama"), "Progressing"))
        await settled(k)

    llama_children = children_of(k, "llama")
    assert "ConfigMap/demo-model-download" not in children_of(k, "demo")
    for owner, objs in ((llama, llama_children), (demo, children_of(k, "demo"))):
        for obj in objs.values():
            assert obj["metadata"]["ownerReferences"] == [
                {
                    "apiVersion": "kvfleet.dev/v1alpha1",
                    "kind": "InferenceService",
                    "name": owner["metadata"]["name"],
                    "uid": owner["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvfleet-operator"

    engine = llama_children["Deployment/llama-engine"]
    pod = engine["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry/engine:1"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["initContainers"][0]["name"] == "model-download"
    assert engine["spec"]["replicas"] == 1
    router = llama_children["Deployment/llama-router"]
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "registry/operator:1"
    assert llama_children["Service/llama-engine"]["spec"]["clusterIP"] == "None"

    status = k.live(ISVCS, NS, "llama")["status"]
    assert status["url"] == "http://llama.team-a.svc/v1"
    assert status["modelName"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert status["desiredReplicas"] == 1
    assert status["observedGeneration"] == 1
    assert condition(k.live(ISVCS, NS, "llama"), "Ready")["status"] == "False"
    assert condition(k.live(ISVCS, NS, "llama"), "Progressing")["status"] == "True"
    assert condition(k.live(ISVCS, NS, "llama"), "Degraded")["status"] == "False"
    assert_rbac_covers(k)


async def test_reconciling_an_unchanged_spec_writes_nothing(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await eventually(lambda: condition(k.live(ISVCS, NS, "llama"), "Ready"))
        await settled(k)
        assert writes(k)  # it did create things

        mark = len(k)
        # An edit that is no change to the spec: a new event, a full reconcile, no write.
        await api(k, "patch", url(ISVCS, "llama"), {"metadata": {"labels": {"team": "a"}}})
        await reconciled_after(k, mark, "llama")
        assert by_operator(k, mark)
        assert writes(k, mark) == []
    assert_rbac_covers(k)


async def test_spec_changes_roll_out_and_hand_edits_are_undone(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await settled(k)

        mark = len(k)
        patch = {"spec": {"engine": {"maxNumSeqs": 32, "dtype": "float16"}}}
        await api(k, "patch", url(ISVCS, "llama"), patch)

        def engine_args() -> list[str]:
            deploy = k.live(DEPLOYMENTS, NS, "llama-engine")
            return deploy["spec"]["template"]["spec"]["containers"][0]["args"]

        await eventually(lambda: "32" in engine_args() and "float16" in engine_args())
        await reconciled_after(k, mark, "llama")
        # Only the engine's pod template changed: one write to it, one to the status.
        assert sorted(writes(k, mark)) == [
            f"PATCH {url(DEPLOYMENTS, 'llama-engine')}",
            f"PATCH {url(ISVCS, 'llama', 'status')}",
        ]
        assert k.live(ISVCS, NS, "llama")["status"]["observedGeneration"] == 2

        await api(k, "delete", url(SERVICES, "llama"))
        await eventually(lambda: k.live(SERVICES, NS, "llama"))

        edited = copy.deepcopy(k.live(DEPLOYMENTS, NS, "llama-router")["spec"]["template"])
        edited["spec"]["containers"][0]["image"] = "someone/else:latest"
        await api(k, "patch", url(DEPLOYMENTS, "llama-router"), {"spec": {"template": edited}})

        def router_image() -> str:
            deploy = k.live(DEPLOYMENTS, NS, "llama-router")
            return deploy["spec"]["template"]["spec"]["containers"][0]["image"]

        await eventually(lambda: router_image() == "registry/operator:1")

        # hf:// to a path: the download ConfigMap is no longer needed and goes.
        await api(k, "patch", url(ISVCS, "llama"), {
            "spec": {"model": {"source": "/models/llama", "hfTokenSecretRef": None},
                     "modelCache": None}
        })  # fmt: skip
        await eventually(lambda: k.live(CONFIGMAPS, NS, "llama-model-download") is None)
        await settled(k)
    assert_rbac_covers(k)


async def test_fields_added_by_hand_where_the_operator_owns_the_value_are_removed(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await settled(k)

        # The router Service would match no pod, the engine pods would go to no node.
        edited = len(k)
        await api(k, "patch", url(SERVICES, "llama"), {"spec": {"selector": {"app": "evil"}}})
        engine_pod = k.live(DEPLOYMENTS, NS, "llama-engine")["spec"]["template"]["spec"]
        added = {
            "nodeSelector": {"kubernetes.io/hostname": "no-such-node"},
            "containers": [*engine_pod["containers"], {"name": "miner", "image": "evil:1"}],
        }
        await api(k, "patch", url(DEPLOYMENTS, "llama-engine"),
                  {"spec": {"template": {"spec": added}}})  # fmt: skip

        def restored() -> bool:
            selector = k.live(SERVICES, NS, "llama")["spec"]["selector"]
            pod = k.live(DEPLOYMENTS, NS, "llama-engine")["spec"]["template"]["spec"]
            return (
                "app" not in selector
                and not pod.get("nodeSelector")
                and [c["name"] for c in pod["containers"]] == ["engine"]
            )

        await eventually(restored)
        await settled(k)
        # One merge patch each (an apply would not remove another manager's fields), then quiet.
        assert sorted(w for w in writes(k, edited) if "/status" not in w) == [
            f"PATCH {url(SERVICES, 'llama')}",
            f"PATCH {url(DEPLOYMENTS, 'llama-engine')}",
        ]
        mark = len(k)
        await api(k, "patch", url(ISVCS, "llama"), {"metadata": {"labels": {"team": "a"}}})
        await reconciled_after(k, mark, "llama")
        assert writes(k, mark) == []
    assert_rbac_covers(k)


async def test_an_addition_that_comes_back_is_reported_and_not_fought_in_a_loop(cluster):
    k = cluster
    stamp = k._stamp

    def webhook(request: Any) -> None:
        """A mutating admission webhook: every write of the engine Deployment gains a key."""
        stamp(request)
        if request.resource == DEPLOYMENTS and request.name == "llama-engine":
            pod = request.data.setdefault("spec", {}).setdefault("template", {})
            pod.setdefault("spec", {}).setdefault("nodeSelector", {})["pool"] = "webhook"

    k._stamp = webhook
    async with operator(k):
        await create(k, LLAMA, "llama")
        degraded = await eventually(
            lambda: condition(k.live(ISVCS, NS, "llama"), "Degraded").get("reason")
        )
        assert degraded == "AddedFieldsKept"
        assert "nodeSelector" in condition(k.live(ISVCS, NS, "llama"), "Degraded")["message"]
        mark = len(k)
        await asyncio.sleep(2.0)
        # Retried with the growing backoff (0.2 s doubling here), not at once after each write.
        engine_writes = writes(k, mark).count(f"PATCH {url(DEPLOYMENTS, 'llama-engine')}")
        assert 1 <= engine_writes <= 5


async def test_status_follows_the_children(cluster):
    k = cluster
    async with operator(k):
        await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await settled(k)

        await mark_ready(k, "demo-engine", 1)
        await mark_ready(k, "demo-router", 1)
        isvc = await eventually(
            lambda: (
                (o := k.live(ISVCS, NS, "demo"))
                and condition(o, "Ready").get("status") == "True"
                and o
            )
        )
        assert (isvc["status"]["replicas"], isvc["status"]["readyReplicas"]) == (1, 1)
        assert condition(isvc, "Progressing")["status"] == "False"
        assert condition(isvc, "Degraded")["status"] == "False"

        crashing = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "demo-engine-7d9f-x1",
                "namespace": NS,
                "labels": children_of(k, "demo")["Deployment/demo-engine"]["spec"]["template"][
                    "metadata"
                ]["labels"],
            },
            "status": {
                "containerStatuses": [
                    {
                        "name": "engine",
                        "image": "registry/engine:1",
                        "restartCount": 4,
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}},
                    }
                ]
            },
        }
        await api(k, "post", url(PODS), crashing)
        degraded = await eventually(
            lambda: (
                condition(k.live(ISVCS, NS, "demo"), "Degraded").get("status") == "True"
                and condition(k.live(ISVCS, NS, "demo"), "Degraded")
            )
        )
        assert degraded["reason"] == "CrashLoopBackOff"
        assert "demo-engine-7d9f-x1" in degraded["message"] and "exit code 2" in degraded["message"]

        def warning_events() -> list[dict[str, Any]]:
            return [
                e
                for e in k.every(EVENTS)
                if e["involvedObject"]["name"] == "demo" and e["type"] == "Warning"
            ]

        events = await eventually(warning_events)
        assert events[0]["reason"] == "CrashLoopBackOff"
        assert events[0]["involvedObject"]["kind"] == "InferenceService"

        await api(k, "delete", url(PODS, "demo-engine-7d9f-x1"))
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "demo"), "Degraded").get("status") == "False"
        )
        await settled(k)
    assert_rbac_covers(k)


async def test_a_tensor_parallel_service_is_reconciled_like_any_other(cluster):
    k = cluster
    async with operator(k):
        await create(k, QWEN_TP2, "qwen")
        await eventually(lambda: set(children_of(k, "qwen")) == child_names("qwen", download=True))
        await eventually(lambda: condition(k.live(ISVCS, NS, "qwen"), "Progressing"))
        await settled(k)

        isvc = k.live(ISVCS, NS, "qwen")
        assert condition(isvc, "Degraded")["status"] == "False"
        assert isvc["status"]["desiredReplicas"] == 1
        pod = children_of(k, "qwen")["Deployment/qwen-engine"]["spec"]["template"]["spec"]
        engine = pod["containers"][0]
        assert engine["args"][engine["args"].index("--tensor-parallel-size") + 1] == "2"
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod[
            "volumes"
        ]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]

        # Reconciled again, unchanged: the /dev/shm volume is no reason to write.
        mark = len(k)
        await api(k, "patch", url(ISVCS, "qwen"), {"metadata": {"labels": {"team": "a"}}})
        await reconciled_after(k, mark, "qwen")
        assert writes(k, mark) == []

        # Removed by hand, it comes back: the operator writes the engine Deployment again.
        template = copy.deepcopy(pod)
        template["volumes"] = [v for v in pod["volumes"] if v["name"] != "dshm"]
        mark = len(k)
        await api(
            k, "patch", url(DEPLOYMENTS, "qwen-engine"), {"spec": {"template": {"spec": template}}}
        )

        def volumes() -> list[str]:
            deploy = k.live(DEPLOYMENTS, NS, "qwen-engine")
            return [v["name"] for v in deploy["spec"]["template"]["spec"]["volumes"]]

        await eventually(lambda: "dshm" in volumes())
        assert f"PATCH {url(DEPLOYMENTS, 'qwen-engine')}" in writes(k, mark)
        await settled(k)
    assert_rbac_covers(k)


INVALID = {
    # name: (spec, words of the Degraded message)
    "bad-bounds": ({"autoscaling": {"minReplicas": 3, "maxReplicas": 1}}, "minReplicas"),
    "bad-source": ({"model": {"source": "s3://bucket/m"}}, "spec.model.source"),
    "bad-field": ({"engine": {"maxTokens": 5}}, "spec.engine.maxTokens"),
    "bad-tp": (
        {"engine": {"tensorParallelSize": 2}, "resources": {"gpus": 1}},
        "tensorParallelSize",
    ),
    "bad-util": ({"engine": {"gpuMemoryUtilization": 3}}, "gpuMemoryUtilization"),
}


async def test_invalid_specs_are_reported_and_the_operator_keeps_going(cluster):
    k = cluster
    async with operator(k):
        for name, (spec, _) in INVALID.items():
            await create(
                k, {"apiVersion": DEMO["apiVersion"], "kind": DEMO["kind"], "spec": spec}, name
            )

        for name, (_, words) in INVALID.items():
            cond = await eventually(
                lambda name=name: (
                    condition(k.live(ISVCS, NS, name), "Degraded").get("status") == "True"
                    and condition(k.live(ISVCS, NS, name), "Degraded")
                )
            )
            assert cond["reason"] == "InvalidSpec"
            assert words in cond["message"]
            assert children_of(k, name) == {}

        def invalid_spec_events() -> set[str]:
            return {
                e["involvedObject"]["name"]
                for e in k.every(EVENTS)
                if e["reason"] == "InvalidSpec" and e["type"] == "Warning"
            }

        await eventually(lambda: invalid_spec_events() == set(INVALID))

        # Still running: a good one is served, and a good one gone bad keeps its children.
        await create(k, DEMO, "good")
        await eventually(lambda: set(children_of(k, "good")) == child_names("good"))
        await settled(k)
        mark = len(k)
        await api(k, "patch", url(ISVCS, "good"), {"spec": {"engine": {"dtype": "int4"}}})
        cond = await eventually(
            lambda: (
                condition(k.live(ISVCS, NS, "good"), "Degraded").get("reason") == "InvalidSpec"
                and condition(k.live(ISVCS, NS, "good"), "Degraded")
            )
        )
        assert "spec.engine.dtype" in cond["message"]
        await settled(k)
        # The status says why and an Event tells; the children are not touched.
        made = writes(k, mark)
        assert made.count(f"PATCH {url(ISVCS, 'good', 'status')}") == 1
        assert set(made) == {f"PATCH {url(ISVCS, 'good', 'status')}", f"POST {url(EVENTS)}"}
        assert set(children_of(k, "good")) == child_names("good")
    assert_rbac_covers(k)


async def test_a_restarted_operator_adopts_what_exists_without_writing(cluster):
    k = cluster
    async with operator(k):
        await create(k, LLAMA, "llama")
        await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "llama")) == LLAMA_CHILDREN)
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await settled(k)
        await mark_ready(k, "demo-engine", 1)
        await mark_ready(k, "demo-router", 1)
        await eventually(
            lambda: condition(k.live(ISVCS, NS, "demo"), "Ready").get("status") == "True"
        )
        await settled(k)
    before = {name: copy.deepcopy(children_of(k, name)) for name in ("llama", "demo")}
    objects = len(k.objects)

    mark = len(k)
    async with operator(k):
        await reconciled_after(k, mark, "llama")
        await reconciled_after(k, mark, "demo")
    assert writes(k, mark) == []
    assert len(k.objects) == objects
    assert {name: children_of(k, name) for name in ("llama", "demo")} == before
    assert_rbac_covers(k)


async def test_allow_lists_keep_a_violating_service_from_rolling_out(cluster):
    """Issue 15: with allow-lists configured, a spec naming another image or Secret gets
    Degraded with the reason and a Warning Event, and nothing of it is applied."""
    k = cluster
    config = OperatorConfig(
        engine_image="registry/engine:1",
        router_image="registry/operator:1",
        allowed_images=("registry/",),
        allowed_secrets=("api-keys",),
    )
    bad_image = copy.deepcopy(DEMO)
    bad_image["spec"].setdefault("engine", {})["image"] = "docker.io/attacker/engine:1"
    bad_secret = copy.deepcopy(DEMO)
    bad_secret["spec"].setdefault("engine", {})["env"] = [
        {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "p"}}}
    ]

    def degraded(name: str) -> dict[str, Any]:
        cond = condition(k.live(ISVCS, NS, name), "Degraded")
        return cond if cond.get("status") == "True" else {}

    def warnings(reason: str) -> set[str]:
        return {
            e["involvedObject"]["name"]
            for e in k.every(EVENTS)
            if e["reason"] == reason and e["type"] == "Warning"
        }

    async with operator(k, config):
        await create(k, bad_image, "bad-image")
        await create(k, bad_secret, "bad-secret")
        image = await eventually(lambda: degraded("bad-image"))
        secret = await eventually(lambda: degraded("bad-secret"))
        assert image["reason"] == "ImageNotAllowed" and "docker.io/attacker" in image["message"]
        assert secret["reason"] == "SecretNotAllowed" and "'db-password'" in secret["message"]
        await eventually(lambda: warnings("ImageNotAllowed") == {"bad-image"})
        await eventually(lambda: warnings("SecretNotAllowed") == {"bad-secret"})
        assert children_of(k, "bad-image") == {} and children_of(k, "bad-secret") == {}
        assert k.live(DEPLOYMENTS, NS, "bad-image-engine") is None

        # An allowed spec is served; changed to a forbidden image, it keeps what it has.
        good = copy.deepcopy(DEMO)
        good["spec"].setdefault("engine", {})["image"] = "registry/engine:2"
        await create(k, good, "good")
        await eventually(lambda: set(children_of(k, "good")) == child_names("good"))
        await settled(k)
        mark = len(k)
        patch = {"spec": {"routing": {"image": "docker.io/attacker/router:1"}}}
        await api(k, "patch", url(ISVCS, "good"), patch)
        cond = await eventually(lambda: degraded("good"))
        assert cond["reason"] == "ImageNotAllowed" and "spec.routing.image" in cond["message"]
        await settled(k)
        assert set(writes(k, mark)) == {
            f"PATCH {url(ISVCS, 'good', 'status')}",
            f"POST {url(EVENTS)}",
        }
        router = k.live(DEPLOYMENTS, NS, "good-router")
        assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "registry/operator:1"
    assert_rbac_covers(k)


async def test_a_namespaced_operator_needs_only_its_namespaced_roles(cluster):
    """The chart's namespaced mode: the operator run with --namespace makes no cluster-scoped
    call and nothing beyond the Role of rbac.NAMESPACED_OPERATOR_RULES."""
    k = cluster
    async with operator(k, namespaces=[NS]):
        await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await eventually(lambda: condition(k.live(ISVCS, NS, "demo"), "Progressing"))
        await settled(k)
    assert_rbac_covers(k, NAMESPACED_OPERATOR_RULES)
    for r in by_operator(k):
        if r.resource is not None and r.resource.plural is not None:
            assert r.namespace == NS, (r.method, r.url.path)
