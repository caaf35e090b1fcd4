"""docs/operations.md's "Run the engine image", as the image tests run it: each ```sh block that
starts the CPU engine, verbatim but for what a test must choose itself (the host port, the cache
volume's name, the image when KVFLEET_ENGINE_IMAGE names another) and --detach in place of --rm
(the test removes the container, after printing its log); the docs' `$MODEL_DIR` and
`$GGUF_FILE` are the test's models."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from tests.support.containers import ENGINE_IMAGE, Container
from tests.support.doc_commands import section, sh_blocks

ROOT = Path(__file__).resolve().parents[2]
SECTION = section((ROOT / "docs" / "operations.md").read_text(), "Run the engine image")
DOC_CPU_IMAGE = "kvfleet/engine-cpu:dev"
DOC_GPU_IMAGE = "kvfleet/engine-gpu:dev"
DOC_PORT = "-p 8000:8000"
DOC_URL = "localhost:8000"
DOC_VOLUME = "kvfleet-cache:/tmp"
# The section's server blocks by what tells them apart, and its one-shot command;
# tests/images/test_run_engine_image.py checks that every CPU `docker run` is one of them.
SERVERS = {
    "default model": (f"docker run --rm -p 8000:8000 {DOC_CPU_IMAGE}\n",),
    "model directory": ('"$MODEL_DIR:/models/model:ro"', DOC_PORT, DOC_CPU_IMAGE),
    "gguf file": ('"$GGUF_FILE:/models/model.gguf:ro"', DOC_CPU_IMAGE),
    "key, cache, read-only": ("--env-file engine.env", DOC_CPU_IMAGE),
}
GENERATE = ("--entrypoint kvfleet-engine", DOC_CPU_IMAGE, "generate")


def blocks_with(*needles: str) -> list[str]:
    return [b for b in sh_blocks(SECTION) if all(n in b for n in needles)]


def block_with(*needles: str) -> str:
    """The one ```sh block of the section holding every needle."""
    (block,) = blocks_with(*needles)
    return block


def as_run_here(block: str, *, port: int | None = None, volume: str | None = None) -> str:
    """The block as a test runs it: the engine on host port `port` (detached) or in the
    foreground (port None), the cache volume named `volume`, the image under test."""
    script = block.replace(DOC_CPU_IMAGE, ENGINE_IMAGE)
    if port is not None:
        assert script.count(DOC_PORT) == 1 and script.count("docker run --rm ") == 1, block
        # Detached, and left for the test to remove: a container that exits keeps its log.
        script = script.replace("docker run --rm ", "docker run --detach ")
        script = script.replace(DOC_PORT, f"-p {port}:8000")
    if volume is not None:
        assert DOC_VOLUME in script, block
        script = script.replace(DOC_VOLUME, f"{volume}:/tmp")
    return script


def with_port(block: str, port: int) -> str:
    """A block of client commands (curl) sent to `port` rather than 8000."""
    assert DOC_URL in block, block
    return block.replace(DOC_URL, f"127.0.0.1:{port}")


def shell(script: str, workdir: Path, env: dict[str, str], timeout: float = 120
          ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """bash runs the script in workdir, failing at its first failing command."""
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=workdir, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, **env},
    )  # fmt: skip


@dataclasses.dataclass
class Served:
    """An engine container that a documented block started."""

    block: str
    port: int
    box: Container
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"
