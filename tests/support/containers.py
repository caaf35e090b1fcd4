"""Docker for the image tests (tests/images): the daemon and the built images, or a skip that
becomes a failure under KVFLEET_REQUIRE_DOCKER=1 (what `make image-test` sets); containers that
are removed afterwards, their logs printed (pytest shows them when a test fails)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvfleet.engine.default_model import DEFAULT_MODEL_NAME
from tests.support.net import http_call

ENGINE_IMAGE = os.environ.get("KVFLEET_ENGINE_IMAGE", "kvfleet/engine-cpu:dev")
OPERATOR_IMAGE = os.environ.get("KVFLEET_OPERATOR_IMAGE", "kvfleet/operator:dev")
GPU_ENGINE_IMAGE = os.environ.get("KVFLEET_GPU_ENGINE_IMAGE", "kvfleet/engine-gpu:dev")
# As Kubernetes runs the pods: a read-only root filesystem with a writable tmpfs /tmp, every
# capability dropped, no new privileges. On the host's network: the loopback is shared.
AS_PODS_RUN = [
    "--read-only",
    "--tmpfs=/tmp:rw,mode=1777,size=1g",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    "--network=host",
]


def unavailable(message: str) -> NoReturn:
    if os.environ.get("KVFLEET_REQUIRE_DOCKER"):
        pytest.fail(message)
    pytest.skip(message)


def docker_exe() -> str:
    """The docker client, once its daemon answers."""
    exe = shutil.which("docker")
    if exe is None:
        unavailable("docker not found (apt-get install docker.io)")
    info = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        unavailable(f"the docker daemon does not answer: {info.stderr.strip()[-300:]}")
    return exe


def require_images(docker: str, *images: str, build: str = "make images") -> None:
    for image in images:
        found = subprocess.run([docker, "image", "inspect", image], capture_output=True, timeout=30)
        if found.returncode != 0:
            unavailable(f"image {image} not built ({build})")


@dataclasses.dataclass
class Container:
    id: str
    waiter: subprocess.Popen[bytes]  # `docker wait`: exits when the container does

    def running(self) -> bool:
        return self.waiter.poll() is None


@contextlib.contextmanager
def removed_after(docker: str, cid: str, label: str) -> Iterator[Container]:
    """The started container `cid`; its log is printed and it is removed afterwards."""
    waiter = subprocess.Popen([docker, "wait", cid], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield Container(cid, waiter)
    finally:
        logs = subprocess.run([docker, "logs", cid], capture_output=True, text=True, timeout=30)
        print(f"--- {label}\n{logs.stdout}{logs.stderr}")
        subprocess.run([docker, "rm", "--force", cid], capture_output=True, timeout=60)
        waiter.wait(timeout=30)


@contextlib.contextmanager
def container(docker: str, image: str, uid: int, *args: str, mounts: dict[Path, str] | None = None
              ) -> Iterator[Container]:  # fmt: skip
    """A running container of `image` as pods run (AS_PODS_RUN, `uid`), its command replaced
    by args, `mounts` read-only."""
    volumes = [f"--volume={src}:{dst}:ro" for src, dst in (mounts or {}).items()]
    started = subprocess.run(
        [docker, "run", "--detach", *AS_PODS_RUN, f"--user={uid}:{uid}", *volumes, image, *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    with removed_after(docker, started.stdout.strip(), f"{image} {' '.join(args)}") as box:
        yield box


def wait_healthy(box: Container, url: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert box.running(), f"the container exited before {url} answered"
        with contextlib.suppress(OSError):
            if http_call(url)[0] == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer 200 in {timeout} s")


QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]


def ask_capital(base_url: str, api_key: str = "unused") -> str:
    """The default model's greedy answer to QUESTION, from the official openai client."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0
    )
    return reply.choices[0].message.content or ""
