"""Black-box tests of the built images, run as Kubernetes runs the pods (tests/support/containers.py
AS_PODS_RUN: a read-only root filesystem with a writable tmpfs /tmp, the pod spec's non-root uid,
every capability dropped, no new privileges):

- a router container (operator image) in front of the CPU engine container, which the openai
  client asks for France's capital through it;
- the operator container, given a kubeconfig for the kmock API emulator this test runs,
  reconciles an InferenceService into its Deployments, Services and router.

The engine image on its own, as docs/operations.md runs it: test_run_engine_image.py. The images
are built by `make images` (images/build.sh); KVFLEET_ENGINE_IMAGE and KVFLEET_OPERATOR_IMAGE
name others. Without docker or the images these tests skip, and fail under
KVFLEET_REQUIRE_DOCKER=1 (what `make image-test` sets), so that nothing silently skips there.
Containers share the host's network: the emulator and the ports they serve are on its loopback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvfleet.operator.resources import RUN_AS
from tests.support.containers import (
    ENGINE_IMAGE,
    OPERATOR_IMAGE,
    ask_capital,
    container,
    require_images,
    wait_healthy,
)
from tests.support.kmock import (
    DEMO,
    APIServer,
    children_of,
    create,
    eventually,
    write_kubeconfig,
)
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
# The operator's own pod runs as the chart's uid; engines and routers as the pod spec's.
OPERATOR_UID = yaml.safe_load((ROOT / "charts/kvfleet/values.yaml").read_text())[
    "podSecurityContext"
]["runAsUser"]


def test_router_container_in_front_of_the_engine(docker: str, default_engine: str) -> None:
    """The router container in front of the engine container that docs/operations.md's first
    `docker run` starts."""
    require_images(docker, OPERATOR_IMAGE)
    port = free_port()
    with container(
        docker, OPERATOR_IMAGE, RUN_AS,
        "kvfleet-router", "--host", "127.0.0.1", "--port", str(port), "--endpoints", default_engine,
    ) as box:  # fmt: skip
        wait_healthy(box, f"http://127.0.0.1:{port}/health", timeout=60)
        assert "Paris" in ask_capital(f"http://127.0.0.1:{port}/v1")


@pytest.mark.asyncio
async def test_operator_container_reconciles_an_inferenceservice(
    docker: str, cluster: APIServer, tmp_path: Path
) -> None:
    require_images(docker, OPERATOR_IMAGE)
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", str(cluster.url))
    args = [
        "kvfleet-operator", "run",
        f"--health-address=127.0.0.1:{free_port()}",
        f"--metrics-address=127.0.0.1:{free_port()}",
        # The demo asks for no GPU: its engine runs the CPU image, not the CUDA one.
        "--engine-image=kvfleet/engine:cuda-not-for-this-spec",
        f"--engine-cpu-image={ENGINE_IMAGE}",
        f"--router-image={OPERATOR_IMAGE}",
    ]  # fmt: skip
    with container(
        docker, OPERATOR_IMAGE, OPERATOR_UID, "env", "KUBECONFIG=/etc/kvfleet/kubeconfig", *args,
        mounts={kubeconfig: "/etc/kvfleet/kubeconfig"},
    ) as box:  # fmt: skip
        name = DEMO["metadata"]["name"]
        await create(cluster, DEMO)

        def reconciled() -> dict[str, dict]:
            """the engine and router Deployments and Services"""
            assert box.running(), "the operator container exited"
            children = children_of(cluster, name)
            wanted = {
                f"Deployment/{name}-engine",
                f"Service/{name}-engine",
                f"Deployment/{name}-router",
                f"Service/{name}",
            }
            return children if wanted <= set(children) else {}

        children = await eventually(reconciled, timeout=90)
        (engine,) = children[f"Deployment/{name}-engine"]["spec"]["template"]["spec"]["containers"]
        assert engine["image"] == ENGINE_IMAGE
        (router,) = children[f"Deployment/{name}-router"]["spec"]["template"]["spec"]["containers"]
        assert router["image"] == OPERATOR_IMAGE
