"""The PodDisruptionBudgets an InferenceService owns: one for its engine pods, one for its router
pods (operator/resources.py disruption_budget), built from spec.engine.disruptionBudget and
spec.routing.disruptionBudget, applied, kept and garbage-collected like every other child."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from kvfleet.operator.drift import excess
from kvfleet.operator.resources import Owner, build_children
from kvfleet.operator.spec import SpecError, parse_spec
from tests.support.kmock import (
    CONFIG,
    DEMO,
    DEPLOYMENTS,
    ISVCS,
    LLAMA,
    NS,
    PDBS,
    QWEN_TP2,
    APIServer,
    api,
    assert_rbac_covers,
    child_names,
    children_of,
    create,
    eventually,
    operator,
    reconciled_after,
    settled,
    url,
    writes,
)

OWNER = Owner(name="llm", namespace=NS, uid="0b8f7c1e-0000-4000-8000-000000000002")
EXAMPLES = pytest.mark.parametrize("raw", [DEMO, LLAMA, QWEN_TP2], ids=["demo", "llama", "qwen"])


def children(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objs = build_children(OWNER, parse_spec("llm", raw.get("spec", raw)), CONFIG)
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


@EXAMPLES
@pytest.mark.parametrize("kube_version", ["1.29", "1.35"])
def test_each_component_gets_a_budget_over_its_own_pods(raw, kube_version):
    objs = children(raw)
    for component in ("engine", "router"):
        pdb = objs[f"PodDisruptionBudget/llm-{component}"]
        kubernetes_validate.validate(pdb, kube_version, strict=True)
        deploy = objs[f"Deployment/llm-{component}"]
        # The Deployment's own selector: exactly its pods, not the other component's.
        assert pdb["spec"]["selector"] == deploy["spec"]["selector"]
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        other = objs[f"Deployment/llm-{'router' if component == 'engine' else 'engine'}"]
        other_labels = other["spec"]["template"]["metadata"]["labels"]
        assert not pdb["spec"]["selector"]["matchLabels"].items() <= other_labels.items()
        # maxUnavailable, never minAvailable: one replica may still move, zero holds nothing.
        assert "minAvailable" not in pdb["spec"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    # Created before the pods they protect.
    order = list(objs)
    for component in ("engine", "router"):
        pdb = order.index(f"PodDisruptionBudget/llm-{component}")
        assert pdb < order.index(f"Deployment/llm-{component}")


def test_the_budgets_follow_the_spec():
    raw = {
        "resources": {"gpus": 0},
        "engine": {"disruptionBudget": {"maxUnavailable": "25%"}},
        "routing": {"replicas": 3, "disruptionBudget": {"maxUnavailable": 2}},
    }
    objs = children(raw)
    assert objs["PodDisruptionBudget/llm-engine"]["spec"]["maxUnavailable"] == "25%"
    assert objs["PodDisruptionBudget/llm-router"]["spec"]["maxUnavailable"] == 2
    kubernetes_validate.validate(objs["PodDisruptionBudget/llm-engine"], "1.29", strict=True)


@pytest.mark.parametrize("value", [0, -1, 1001, "0%", "101%", "2", "50", True, 1.5, "10 %"])
def test_a_budget_that_could_block_every_drain_or_is_no_count_is_refused(value):
    for component in ("engine", "routing"):
        with pytest.raises(SpecError, match=rf"spec\.{component}\.disruptionBudget"):
            parse_spec("llm", {component: {"disruptionBudget": {"maxUnavailable": value}}})


def test_a_selector_key_added_to_a_budget_is_excess():
    desired = children(DEMO)["PodDisruptionBudget/llm-engine"]
    live = copy.deepcopy(desired)
    live["metadata"]["resourceVersion"] = "7"
    live["spec"]["selector"]["matchLabels"]["pool"] = "none"
    found = excess(desired, live)
    assert found is not None and found.paths == ["spec.selector"]
    assert found.patch["spec"] == {"selector": {"matchLabels": {"pool": None}}}


# ---------------------------------------------------------------------------------------------
# on the API emulator, under the real kopf runtime


def budgets(k: APIServer, name: str) -> dict[str, dict[str, Any]]:
    return {n: o for n, o in children_of(k, name).items() if n.startswith("PodDisruptionBudget/")}


async def collect_garbage(k: APIServer, uid: str) -> None:
    """Kubernetes' garbage collector, which kmock lacks: what the deleted owner controlled goes."""
    for (resource, namespace, name), obj in list(k.objects.items()):
        if obj.deleted or namespace != NS:
            continue
        refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
        if any(r["uid"] == uid and r.get("controller") for r in refs):
            group_version = "/".join(p for p in (resource.group, resource.version) if p)
            await api(k, "delete", url(f"{group_version}/{resource.plural}", name))


@pytest.mark.asyncio
async def test_budgets_are_applied_kept_and_go_with_their_service(cluster):
    k = cluster
    async with operator(k):
        isvc = await create(k, DEMO, "demo")
        await eventually(lambda: set(children_of(k, "demo")) == child_names("demo"))
        await settled(k)
        pdbs = budgets(k, "demo")
        engine_pod = k.live(DEPLOYMENTS, NS, "demo-engine")["spec"]["template"]["metadata"]
        router_pod = k.live(DEPLOYMENTS, NS, "demo-router")["spec"]["template"]["metadata"]
        for name, pod in (("demo-engine", engine_pod), ("demo-router", router_pod)):
            pdb = pdbs[f"PodDisruptionBudget/{name}"]
            assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["labels"].items()
            assert pdb["spec"]["maxUnavailable"] == 1
            assert pdb["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]

        # A spec change updates the budgets, and nothing else but the status.
        mark = len(k)
        patch = {
            "spec": {
                "engine": {"disruptionBudget": {"maxUnavailable": "50%"}},
                "routing": {"disruptionBudget": {"maxUnavailable": 2}},
            }
        }
        await api(k, "patch", url(ISVCS, "demo"), patch)
        await eventually(
            lambda: (
                k.live(PDBS, NS, "demo-engine")["spec"]["maxUnavailable"] == "50%"
                and k.live(PDBS, NS, "demo-router")["spec"]["maxUnavailable"] == 2
            )
        )
        await reconciled_after(k, mark, "demo")
        assert sorted(writes(k, mark)) == [
            f"PATCH {url(ISVCS, 'demo', 'status')}",
            f"PATCH {url(PDBS, 'demo-engine')}",
            f"PATCH {url(PDBS, 'demo-router')}",
        ]

        # Deleted by hand, a budget comes back; a selector key added to one is taken out.
        await api(k, "delete", url(PDBS, "demo-engine"))
        await eventually(lambda: k.live(PDBS, NS, "demo-engine"))
        selector = {"spec": {"selector": {"matchLabels": {"pool": "none"}}}}
        await api(k, "patch", url(PDBS, "demo-router"), selector)
        await eventually(
            lambda: "pool" not in k.live(PDBS, NS, "demo-router")["spec"]["selector"]["matchLabels"]
        )
        await settled(k)

        # Deleting the service: the garbage collector takes the budgets with the rest (owner
        # references), and the operator creates nothing again.
        await api(k, "delete", url(ISVCS, "demo"))
        await collect_garbage(k, isvc["metadata"]["uid"])
        mark = len(k)
        await settled(k)
        assert children_of(k, "demo") == {}
        assert [w for w in writes(k, mark) if "/events" not in w] == []
    assert_rbac_covers(k)
