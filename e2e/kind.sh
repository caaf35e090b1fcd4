#!/usr/bin/env bash
# The e2e cluster: `e2e/kind.sh up` creates a kind cluster, builds both images (the engine with
# CPU torch), loads them into the cluster and installs the chart; `e2e/kind.sh down` deletes it.
# `make e2e` (pytest e2e) runs both around the tests. Needs docker, kind, kubectl and helm.
set -euo pipefail
cd "$(dirname "$0")/.."
CLUSTER="${KVFLEET_E2E_CLUSTER:-kvfleet-e2e}"
CONTEXT="kind-${CLUSTER}"
TAG=e2e

case "${1:-}" in
  up)
    if ! kind get clusters | grep -qx "$CLUSTER"; then
      kind create cluster --name "$CLUSTER" --wait 180s
    fi
    docker build -f images/operator.Dockerfile -t "kvfleet/operator:${TAG}" .
    # The CPU engine: the e2e InferenceService asks for no GPU, so the operator picks the CPU
    # image (the chart's engine.image.cpuTag).
    docker build -f images/engine.Dockerfile --target cpu -t "kvfleet/engine:${TAG}-cpu" \
      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
    kind load docker-image --name "$CLUSTER" "kvfleet/operator:${TAG}" "kvfleet/engine:${TAG}-cpu"
    helm upgrade --install kvfleet charts/kvfleet --kube-context "$CONTEXT" \
      --namespace kvfleet-system --create-namespace \
      --set image.repository=kvfleet/operator --set "image.tag=${TAG}" \
      --set image.pullPolicy=Never \
      --set engine.image.repository=kvfleet/engine --set "engine.image.cpuTag=${TAG}-cpu" \
      --set logLevel=DEBUG --wait --timeout 5m
    ;;
  down)
    kind delete cluster --name "$CLUSTER"
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
