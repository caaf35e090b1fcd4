"""docs/operations.md's "Run the engine image" and its compose file, checked without docker: the
arguments every documented `docker run` (CPU and GPU) hands the image's entrypoint are ones the
engine accepts, the GPU commands ask for GPUs and, for tensor parallelism, shared memory, and the
compose file's settings agree with the engine's flags and probes. The CPU commands run verbatim in
tests/images/test_run_engine_image.py (make image-test)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml

from kvfleet.engine.cli import build_parser
from kvfleet.engine.server.settings import ServerSettings
from kvfleet.operator.resources import RUN_AS
from tests.support.doc_commands import commands
from tests.support.documented_runs import DOC_CPU_IMAGE, DOC_GPU_IMAGE, SECTION, blocks_with

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "examples" / "docker-compose.engine.yaml"
IMAGES = (DOC_CPU_IMAGE, DOC_GPU_IMAGE)


def entrypoint() -> list[str]:
    """The engine image's ENTRYPOINT (both targets: gpu is built FROM cpu)."""
    lines = (ROOT / "images" / "engine.Dockerfile").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("ENTRYPOINT ")]
    return json.loads(line.removeprefix("ENTRYPOINT "))


def docker_runs() -> list[tuple[list[str], str, list[str]]]:
    """(docker's options, the image, the container's command line) of each documented run."""
    found = []
    for words in commands(SECTION):
        if words[:2] != ["docker", "run"]:
            continue
        (at,) = [i for i, w in enumerate(words) if w in IMAGES]
        options, args = words[2:at], words[at + 1 :]
        if "--entrypoint" in options:
            command = [options[options.index("--entrypoint") + 1], *args]
        else:
            command = [*entrypoint(), *args]
        found.append((options, words[at], command))
    return found


def test_the_image_serves_with_the_arguments_after_it():
    assert entrypoint() == ["kvfleet-engine", "serve"]
    dockerfile = (ROOT / "images" / "engine.Dockerfile").read_text()
    # No CMD: the base image's (python3) is reset by ENTRYPOINT, and no default flags are lost
    # when a user gives their own.
    assert "\nCMD " not in dockerfile


def test_every_documented_run_gives_the_engine_arguments_it_accepts():
    runs = docker_runs()
    assert {image for _, image, _ in runs} == set(IMAGES)
    for _, _, command in runs:
        assert command[0] == "kvfleet-engine", command
        build_parser().parse_args(command[1:])  # a usage error exits the test
        assert "--api-key" not in command, "the key goes in the environment or a file"


def test_the_gpu_commands_ask_for_gpus_and_shared_memory_for_tensor_parallelism():
    gpu = [
        (options, command) for options, image, command in docker_runs() if image == DOC_GPU_IMAGE
    ]
    assert len(gpu) == 2
    for options, command in gpu:
        assert "--gpus" in options
        if "--tensor-parallel-size" in command:
            assert "--ipc=host" in options or "--shm-size" in options
    assert any("--tensor-parallel-size" in command for _, command in gpu)


def test_the_help_command_is_the_image_alone_with_help():
    assert f"`docker run --rm {DOC_CPU_IMAGE} --help`" in SECTION


def test_the_compose_file_agrees_with_the_engine():
    compose = yaml.safe_load(COMPOSE.read_text())
    (service,) = compose["services"].values()
    assert service["image"] == DOC_CPU_IMAGE
    ns = build_parser().parse_args([*entrypoint()[1:], *service["command"]])
    (secret,) = service["secrets"]
    assert secret in compose["secrets"]
    assert ns.api_key_file == f"/run/secrets/{secret}"
    assert service["ports"] == ["8000:8000"] and service["user"] == f"{RUN_AS}:{RUN_AS}"
    assert service["read_only"] and service["cap_drop"] == ["ALL"]
    (volume,) = service["volumes"]
    name, _, path = volume.partition(":")
    assert path == "/tmp" and name in compose["volumes"]
    # The readiness probe (503 while draining), not a path that needs the key.
    assert "http://127.0.0.1:8000/ready" in service["healthcheck"]["test"][-1]
    grace = service["stop_grace_period"]
    assert grace.endswith("s")
    assert float(grace.removesuffix("s")) > ServerSettings().shutdown_timeout
    # The commands the docs give for it.
    for block in blocks_with("docker compose"):
        assert "cp examples/docker-compose.engine.yaml compose.yaml" in block
        assert shlex.split(block.splitlines()[-1]) == ["docker", "compose", "up"]
