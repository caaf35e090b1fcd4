"""External command-line tools the tests run (helm, promtool), found or skipped for."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfleet"
# `make tools` installs helm and kubectl here.
TOOLS_BIN = ROOT / ".tools" / "bin"


def tool(name: str, *extra: Path, install: str, required: bool) -> str:
    """The path of a tool: $NAME, one of `extra`, or on PATH. Missing, a failure where it is
    `required`, else a skip saying how to `install` it."""
    for candidate in [os.environ.get(name.upper()), *map(str, extra), shutil.which(name)]:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    where = ", ".join([f"${name.upper()}", *map(str, extra), "PATH"])
    message = f"{name} not found ({where}): {install}"
    if required:
        pytest.fail(message)
    pytest.skip(message)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    """helm from `make tools`: required under CI=true or KVFLEET_REQUIRE_TOOLS=1 (`make test`)."""
    required = bool(os.environ.get("CI") or os.environ.get("KVFLEET_REQUIRE_TOOLS"))
    exe = tool("helm", TOOLS_BIN / "helm", install="run `make tools`", required=required)
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, check=False)


def helm(*args: str) -> str:
    proc = run_helm(*args)
    assert proc.returncode == 0, f"helm {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def set_args(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]
