"""End to end on a kind cluster: `make e2e` (or `python -m pytest e2e`).

Needs docker (with a reachable daemon), kind, kubectl and helm (`make tools` puts helm and
kubectl in .tools/bin, which `make e2e` adds to PATH). When one is missing, every test skips with
one line that says which; nothing here ever fails for a missing tool, and `make test` does not
collect this folder at all (pyproject.toml's testpaths is tests/).

    KVFLEET_E2E_CLUSTER=name   kind cluster name (default kvfleet-e2e)
    KVFLEET_E2E_REUSE=1        skip `e2e/kind.sh up`: the cluster and chart are there already
    KVFLEET_E2E_KEEP=1         keep the cluster afterwards (default: `e2e/kind.sh down`)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = os.environ.get("KVFLEET_E2E_CLUSTER", "kvfleet-e2e")
CONTEXT = f"kind-{CLUSTER}"


def missing_tool() -> str | None:
    """Why e2e cannot run here, in a few words, or None."""
    for name in ("docker", "kind", "kubectl", "helm"):
        if shutil.which(name) is None:
            return f"{name} not found"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return "docker daemon not answering"
    if info.returncode != 0:
        return "docker daemon not reachable (docker info failed)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = missing_tool()
    if reason is None:
        return
    if os.environ.get("KVFLEET_E2E_REQUIRED"):
        # `make e2e` asked for the end-to-end run: passing on all skips would say it ran.
        raise pytest.UsageError(f"e2e cannot run here: {reason}")
    skip = pytest.mark.skip(reason=f"e2e skipped: {reason}")
    for item in items:
        item.add_marker(skip)


def kind_sh(action: str) -> None:
    subprocess.run([str(ROOT / "e2e" / "kind.sh"), action], check=True, cwd=ROOT, timeout=3600)


@pytest.fixture(scope="session")
def cluster():
    """A kind cluster with both images loaded and the chart installed; its kubectl context."""
    if not os.environ.get("KVFLEET_E2E_REUSE"):
        kind_sh("up")
    yield CONTEXT
    if not os.environ.get("KVFLEET_E2E_KEEP"):
        kind_sh("down")
