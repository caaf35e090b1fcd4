"""Black-box tests of the built images, run as Kubernetes runs the pods: a read-only root
filesystem with a writable tmpfs /tmp, the non-root uid of the pod spec, every capability
dropped, no new privileges.

- the CPU engine image serves its built-in default model: the official openai client gets a chat
  answer naming Paris from it, and through a router container (operator image) in front of it;
- the operator container, given a kubeconfig for the kmock API emulator this test runs,
  reconciles an InferenceService into its Deployments, Services and router.

The images are built by `make images` (images/build.sh); KVFLEET_ENGINE_IMAGE and
KVFLEET_OPERATOR_IMAGE name others. Without docker or the images these tests skip, and fail under
KVFLEET_REQUIRE_DOCKER=1 (what `make image-test` sets), so that nothing silently skips there.
Containers share the host's network: the emulator and the ports they serve are on its loopback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from kvfleet.engine.default_model import DEFAULT_MODEL_NAME
from kvfleet.operator.resources import RUN_AS
from tests.support.kmock import (
    DEMO,
    APIServer,
    children_of,
    create,
    eventually,
    write_kubeconfig,
)
from tests.support.net import free_port, http_call

ROOT = Path(__file__).resolve().parents[2]
ENGINE_IMAGE = os.environ.get("KVFLEET_ENGINE_IMAGE", "kvfleet/engine-cpu:dev")
OPERATOR_IMAGE = os.environ.get("KVFLEET_OPERATOR_IMAGE", "kvfleet/operator:dev")
# The operator's own pod runs as the chart's uid; engines and routers as the pod spec's.
OPERATOR_UID = yaml.safe_load((ROOT / "charts/kvfleet/values.yaml").read_text())[
    "podSecurityContext"
]["runAsUser"]
AS_PODS_RUN = [
    "--read-only",
    "--tmpfs=/tmp:rw,mode=1777,size=1g",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    "--network=host",
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _unavailable(message: str) -> None:
    if os.environ.get("KVFLEET_REQUIRE_DOCKER"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def docker() -> str:
    exe = shutil.which("docker")
    if exe is None:
        _unavailable("docker not found (apt-get install docker.io)")
    info = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        _unavailable(f"the docker daemon does not answer: {info.stderr.strip()[-300:]}")
    for image in (ENGINE_IMAGE, OPERATOR_IMAGE):
        found = subprocess.run([exe, "image", "inspect", image], capture_output=True, timeout=30)
        if found.returncode != 0:
            _unavailable(f"image {image} not built (make images)")
    return exe


@dataclasses.dataclass
class Container:
    id: str
    waiter: subprocess.Popen[bytes]  # `docker wait`: exits when the container does

    def running(self) -> bool:
        return self.waiter.poll() is None


@contextlib.contextmanager
def container(docker: str, image: str, uid: int, *args: str, mounts: dict[Path, str] | None = None
              ) -> Iterator[Container]:  # fmt: skip
    """A running container of `image` (its command replaced by args); its log is printed (shown
    when the test fails), and it is removed afterwards."""
    volumes = [f"--volume={src}:{dst}:ro" for src, dst in (mounts or {}).items()]
    started = subprocess.run(
        [docker, "run", "--detach", *AS_PODS_RUN, f"--user={uid}:{uid}", *volumes, image, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    cid = started.stdout.strip()
    waiter = subprocess.Popen([docker, "wait", cid], stdout=subprocess.DEVNULL)
    try:
        yield Container(cid, waiter)
    finally:
        logs = subprocess.run([docker, "logs", cid], capture_output=True, text=True, timeout=30)
        print(f"--- {image} {' '.join(args)}\n{logs.stdout}{logs.stderr}")
        subprocess.run([docker, "rm", "--force", cid], capture_output=True, timeout=60)
        waiter.wait(timeout=30)


def wait_healthy(box: Container, url: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert box.running(), f"the container exited before {url} answered"
        with contextlib.suppress(OSError):
            if http_call(url)[0] == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer 200 in {timeout} s")


def ask_capital(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0
    )
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def engine(docker: str) -> Iterator[str]:
    """The CPU engine container on its default model, as the demo InferenceService runs it:
    no model argument, the image's own cache variables; its base URL."""
    port = free_port()
    with container(
        docker, ENGINE_IMAGE, RUN_AS,
        "kvfleet-engine", "serve", "--host", "127.0.0.1", "--port", str(port),
    ) as box:  # fmt: skip
        wait_healthy(box, f"http://127.0.0.1:{port}/health")
        yield f"127.0.0.1:{port}"


def test_engine_container_serves_the_default_model(engine: str) -> None:
    status, _, body = http_call(f"http://{engine}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [DEFAULT_MODEL_NAME]
    assert "Paris" in ask_capital(f"http://{engine}/v1")


def test_router_container_in_front_of_the_engine(docker: str, engine: str) -> None:
    port = free_port()
    with container(
        docker, OPERATOR_IMAGE, RUN_AS,
        "kvfleet-router", "--host", "127.0.0.1", "--port", str(port), "--endpoints", engine,
    ) as box:  # fmt: skip
        wait_healthy(box, f"http://127.0.0.1:{port}/health", timeout=60)
        assert "Paris" in ask_capital(f"http://127.0.0.1:{port}/v1")


@pytest.mark.asyncio
async def test_operator_container_reconciles_an_inferenceservice(
    docker: str, cluster: APIServer, tmp_path: Path
) -> None:
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
