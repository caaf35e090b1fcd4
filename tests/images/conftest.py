"""Fixtures of the image tests: docker, and the CPU engine containers that docs/operations.md's
"Run the engine image" starts, all started at once (their model loads overlap) and removed,
with the cache volume, at the end of the session."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from tests.support.containers import (
    ENGINE_IMAGE,
    docker_exe,
    removed_after,
    require_images,
    wait_healthy,
)
from tests.support.documented_runs import SERVERS, Served, as_run_here, block_with, shell
from tests.support.net import free_port


@pytest.fixture(scope="session")
def docker() -> str:
    return docker_exe()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The docs' $MODEL_DIR and $GGUF_FILE: the tests' tiny Llama and its GGUF (fast to load;
    their text is meaningless)."""
    from tests.support.gguf_files import write_gguf
    from tests.support.tiny_model import tiny_model_path

    # Copies the container's uid 1000 can read through the bind mounts (the cache's are the
    # user's own: 0700).
    root = tmp_path_factory.mktemp("models")
    model_dir = shutil.copytree(tiny_model_path(), root / "tiny")
    gguf = write_gguf(model_dir, root / "tiny.gguf", "Q8_0")
    for path in [model_dir, *model_dir.iterdir(), gguf]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return {"MODEL_DIR": str(model_dir), "GGUF_FILE": str(gguf)}


@pytest.fixture(scope="session")
def cache_volume(docker: str) -> Iterator[str]:
    """The docs' kvfleet-cache volume under a name of the test's own, removed afterwards."""
    name = f"kvfleet-cache-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run([docker, "volume", "rm", "--force", name], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def documented(
    docker: str, models: dict[str, str], cache_volume: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Served]]:  # fmt: skip
    """Every server block of SERVERS, started (not yet answering) by name."""
    require_images(docker, ENGINE_IMAGE)
    with contextlib.ExitStack() as stack:
        served = {}
        for name, needles in SERVERS.items():
            block = block_with(*needles)
            port = free_port()
            volume = cache_volume if "kvfleet-cache:" in block else None
            workdir = tmp_path_factory.mktemp("run")
            run = shell(as_run_here(block, port=port, volume=volume), workdir, models)
            assert run.returncode == 0, (block, run.stderr)
            cid = run.stdout.split()[-1]
            box = stack.enter_context(removed_after(docker, cid, f"{name}: {block}"))
            served[name] = Served(block, port, box, workdir)
        yield served


@pytest.fixture(scope="session")
def default_engine(documented: dict[str, Served]) -> str:
    """host:port of the engine the section's first command starts, once it answers."""
    engine = documented["default model"]
    wait_healthy(engine.box, f"{engine.url}/health")
    return f"127.0.0.1:{engine.port}"
