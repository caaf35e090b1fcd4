"""Every permission the operator and the routers it deploys need, written down once.

``kvfleet-operator print-rbac`` renders OPERATOR_RULES as the ClusterRole the Helm chart installs,
``print-rbac -n NAMESPACE...`` NAMESPACED_OPERATOR_RULES as the Role per watched namespace of the
chart's namespaced mode (docs/operations.md#rbac-cluster-wide-or-namespaced).
tests/operator/test_operator_kmock.py checks every API call the operator makes against them.
"""

from __future__ import annotations

from typing import Any, TypedDict


class PolicyRule(TypedDict):
    apiGroups: list[str]
    resources: list[str]
    verbs: list[str]


READ = ["get", "list", "watch"]
MANAGE = [*READ, "create", "patch"]

# What a router does: watch the EndpointSlices of its engine Service to learn the ready engines.
# The operator grants it as a Role per InferenceService (with the router's ServiceAccount and a
# RoleBinding, all owned by the service) rather than the chart binding one ClusterRole per
# namespace: no chart needed before the first service, no ``bind`` verb for the operator, and a
# router reads its own namespace only. Kubernetes lets the operator grant only what it holds.
ROUTER_RULES: tuple[PolicyRule, ...] = (
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ},
)

# Everything but kopf's peering: namespaced resources only.
_RULES: tuple[PolicyRule, ...] = (
    {"apiGroups": ["kvfleet.dev"], "resources": ["inferenceservices"], "verbs": READ},
    {"apiGroups": ["kvfleet.dev"], "resources": ["inferenceservices/status"], "verbs": ["patch"]},
    # Owner references with blockOwnerDeletion need update on the owner's finalizers
    # (the OwnerReferencesPermissionEnforcement admission plugin).
    {
        "apiGroups": ["kvfleet.dev"],
        "resources": ["inferenceservices/finalizers"],
        "verbs": ["update"],
    },
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": MANAGE},
    {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": MANAGE},
    {"apiGroups": [""], "resources": ["services", "serviceaccounts"], "verbs": MANAGE},
    # delete: the model-download ConfigMap goes when a spec stops using an hf:// source.
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": [*MANAGE, "delete"]},
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": MANAGE,
    },
    # Status comes from the pods too: crash loops and image pull errors show only there. patch:
    # the pod-deletion-cost annotation that makes a scale-down remove the coldest engine.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    # Held so that the operator may grant it to routers (see ROUTER_RULES).
    *ROUTER_RULES,
)
PEERING_VERBS = ["get", "list", "watch", "patch"]

# Kopf's peering between operator replicas (--peering): one is active, the others wait. Serving
# all namespaces it uses a ClusterKopfPeering, serving a list a KopfPeering in each.
OPERATOR_RULES: tuple[PolicyRule, ...] = (
    *_RULES,
    {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings", "kopfpeerings"],
        "verbs": PEERING_VERBS,
    },
)
# An operator run with --namespace: the same, as a Role in each namespace. Nothing cluster-scoped:
# with CRD scanning off and exact namespace names kopf lists neither CRDs nor namespaces.
NAMESPACED_OPERATOR_RULES: tuple[PolicyRule, ...] = (
    *_RULES,
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": PEERING_VERBS},
)


def allows(rules: tuple[PolicyRule, ...], group: str, resource: str, verb: str) -> bool:
    """Whether the rules permit a verb on a resource ("pods", or "pods/status")."""
    return any(
        group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
        for rule in rules
    )


def as_manifest(rules: tuple[PolicyRule, ...]) -> list[dict[str, list[str]]]:
    """Rules as fresh lists (no list shared between rules, so YAML has no anchors)."""
    return [
        {
            "apiGroups": list(rule["apiGroups"]),
            "resources": list(rule["resources"]),
            "verbs": list(rule["verbs"]),
        }
        for rule in rules
    ]


def cluster_role(name: str = "kvfleet-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": as_manifest(OPERATOR_RULES),
    }


def namespaced_role(namespace: str, name: str = "kvfleet-operator") -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace},
        "rules": as_manifest(NAMESPACED_OPERATOR_RULES),
    }


def namespaced_role_binding(
    namespace: str, service_account: str, sa_namespace: str, name: str = "kvfleet-operator"
) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": service_account, "namespace": sa_namespace}
        ],
    }
