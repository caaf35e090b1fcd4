"""A plain (non-editable) install works: the wheel, installed into a fresh virtualenv, imports
every module of every kvfleet package and runs each console script's --help, with the source
tree out of reach. tests/test_layout.py checks the wheel's file list; this runs what it holds.
Every install mode (the wheel, pip's default editable mode, the Makefile's strict one) builds
the children of a service that downloads a model, which reads a source file at run time.

The fresh venv takes the third-party dependencies (torch and the rest) from the dev venv through
a .pth line naming its site-packages directory: a path line adds the directory but processes no
.pth file inside it, so the dev venv's editable install (a .pth of its own) stays invisible, and
every kvfleet module must come from the wheel. The test checks that it does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = tuple(PYPROJECT["tool"]["setuptools"]["package-dir"].values())

# Imports each kvfleet module found in the installed package (not in the source tree) and
# reports where each was loaded from.
IMPORT_ALL = """
import importlib, json, pathlib, sys
import kvfleet
found, origins = [], {}
for root in map(pathlib.Path, kvfleet.__path__):
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts)
        module = importlib.import_module(name)
        origins[name] = module.__file__
print(json.dumps({"path": list(kvfleet.__path__), "modules": origins}))
"""


def _sources(tmp: Path) -> Path:
    """A copy of what a build reads, as the images build it: setuptools' build/ of the
    checkout keeps modules deleted since, which would hide a broken import."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _fresh_venv(env_dir: Path) -> Path:
    """A venv that sees the dev venv's third-party packages, and no kvfleet."""
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _pip_install(python: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-build-isolation", "-q", *args],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from a copy of this checkout installed."""
    tmp = tmp_path_factory.mktemp("install")
    src = _sources(tmp)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("kvfleet-*.whl")
    env_dir = tmp / "venv"
    _pip_install(_fresh_venv(env_dir), str(wheel))
    return env_dir


def _run(env_dir: Path, *cmd: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Outside the repository, without PYTHONPATH: the source folders are not on sys.path.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_every_module_imports_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    proc = _run(installed, installed / "bin" / "python", "-c", IMPORT_ALL, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    site = (installed / "lib").resolve()
    assert report["path"] and all(Path(p).resolve().is_relative_to(site) for p in report["path"])
    leaked = {
        name: origin
        for name, origin in report["modules"].items()
        if not Path(origin).resolve().is_relative_to(site)
    }
    assert not leaked, f"modules loaded from outside the installed wheel: {leaked}"
    expected = {
        ".".join(
            ("kvfleet", folder, *p.relative_to(ROOT / folder).with_suffix("").parts)
        ).removesuffix(".__init__")
        for folder in FOLDERS
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "__main__.py"
    }
    assert expected <= set(report["modules"]), sorted(expected - set(report["modules"]))


@pytest.mark.parametrize("script", sorted(PYPROJECT["project"]["scripts"]))
def test_console_script_help(installed: Path, tmp_path: Path, script: str) -> None:
    proc = _run(installed, installed / "bin" / script, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"usage: {script}"), proc.stdout[:500]


# What reconciling a service with an hf:// model builds, the download script's ConfigMap first.
BUILD_DOWNLOADING_SERVICE = """
from pathlib import Path
from kvfleet.operator import model_download
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.resources import Owner, build_children
from kvfleet.operator.spec import parse_spec
spec = parse_spec("llm", {"model": {"source": "hf://org/model"}, "resources": {"gpus": 1}})
owner = Owner(name="llm", namespace="ns", uid="0b8f7c1e-0000-4000-8000-000000000001")
config_map = build_children(owner, spec, OperatorConfig())[0]
assert config_map["data"]["download.py"] == Path(model_download.__file__).read_text()
print(model_download.__file__)
"""


@pytest.mark.parametrize("mode", ["editable", "strict editable"])
def test_an_editable_install_reconciles_a_model_download(mode: str, tmp_path: Path) -> None:
    src = _sources(tmp_path)
    python = _fresh_venv(tmp_path / "venv")
    config = ["--config-settings", "editable_mode=strict"] if mode == "strict editable" else []
    _pip_install(python, "-e", str(src), *config)
    proc = _run(tmp_path / "venv", python, "-c", BUILD_DOWNLOADING_SERVICE, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Loaded through the install from the copy, not from the checkout this test runs in.
    assert Path(proc.stdout.strip()).resolve() == (src / "operator" / "model_download.py")


def test_the_wheel_reconciles_a_model_download(installed: Path, tmp_path: Path) -> None:
    proc = _run(
        installed, installed / "bin" / "python", "-c", BUILD_DOWNLOADING_SERVICE, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert Path(proc.stdout.strip()).resolve().is_relative_to((installed / "lib").resolve())
