"""The GPU engine image (make image-gpu) on a machine without a GPU, what docs/operations.md
("The GPU image") says of it: the CUDA build of torch and the Triton it carries import, with what
Triton compiles its launcher with; started without a GPU it serves on the CPU (--device auto)
and answers; with --device cuda it refuses to start, in one line.

Opt-in: `make image-gpu-test` sets KVFLEET_GPU_IMAGE_TEST=1 (then nothing skips); elsewhere these
tests skip, so that CI's `make image-test` never builds or runs the GPU image. The GPU path
itself (--gpus all) needs a GPU: tests/engine/test_gpu.py runs the engine there."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.containers import (
    GPU_ENGINE_IMAGE,
    ask_capital,
    removed_after,
    require_images,
    wait_healthy,
)
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
TORCH_PIN = (ROOT / "images" / "torch.txt").read_text().split("torch==")[1].split()[0]
pytestmark = pytest.mark.skipif(
    not os.environ.get("KVFLEET_GPU_IMAGE_TEST"), reason="make image-gpu-test runs these"
)


@pytest.fixture(scope="module")
def gpu_image(docker: str) -> str:
    require_images(docker, GPU_ENGINE_IMAGE, build="make image-gpu")
    return GPU_ENGINE_IMAGE


def python_in(docker: str, image: str, code: str) -> str:
    run = subprocess.run(
        [docker, "run", "--rm", "--entrypoint", "python3", image, "-c", code],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_cuda_torch_and_triton_import(docker: str, gpu_image: str):
    code = (
        "import json, os, sysconfig, torch, triton\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "    'triton': triton.__version__, 'gpu': torch.cuda.is_available(),\n"
        "    'headers': os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')}))\n"
    )
    found = json.loads(python_in(docker, gpu_image, code))
    # PyPI's CUDA build (2.13.0+cu130), not torch's CPU one (+cpu).
    version, _, build = found["torch"].partition("+")
    assert version == TORCH_PIN and build != "cpu", found
    assert found["cuda"] and found["triton"], found
    assert found["headers"] and not found["gpu"], found
    gcc = subprocess.run([docker, "run", "--rm", "--entrypoint", "gcc", gpu_image, "--version"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert gcc.returncode == 0, gcc.stderr


@pytest.fixture(scope="module")
def served_on_the_cpu(docker: str, gpu_image: str) -> Iterator[tuple[str, str]]:
    """The GPU image as the docs' first command runs the CPU one, no GPU given; its URL and id."""
    port = free_port()
    started = subprocess.run([docker, "run", "--detach", "-p", f"{port}:8000", gpu_image],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert started.returncode == 0, started.stderr
    cid = started.stdout.strip()
    with removed_after(docker, cid, f"{gpu_image} without a GPU") as box:
        wait_healthy(box, f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}", cid


def test_without_a_gpu_it_serves_on_the_cpu(docker: str, served_on_the_cpu: tuple[str, str]):
    url, cid = served_on_the_cpu
    assert "Paris" in ask_capital(f"{url}/v1")
    logs = subprocess.run([docker, "logs", cid], capture_output=True, text=True, timeout=30)
    assert " on cpu x1" in logs.stdout + logs.stderr


def test_device_cuda_without_a_gpu_refuses_in_one_line(docker: str, gpu_image: str):
    run = subprocess.run([docker, "run", "--rm", gpu_image, "--device", "cuda"],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    # One error line, the last: before it only the start's log (the default model unpacked).
    lines = (run.stdout + run.stderr).strip().splitlines()
    errors = [line for line in lines if " ERROR " in line or "Traceback" in line]
    assert errors == lines[-1:], lines
    assert "device='cuda' was asked for but no CUDA device is visible" in lines[-1]
