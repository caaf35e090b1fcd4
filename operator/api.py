"""The InferenceService API's names: its group, version and resource, the resource name of each
kind of child, and the labels that tie every child (pods included) to its InferenceService."""

from __future__ import annotations

GROUP = "kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# The plural resource name of each kind of child.
PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets",
}

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# Maps any child (pods included, which are owned by ReplicaSets) back to its InferenceService.
LABEL_ISVC = "kvfleet.dev/inferenceservice"
MANAGED_BY = "kvfleet-operator"
