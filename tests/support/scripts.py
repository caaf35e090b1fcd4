"""The repository's scripts (bench/*.py, scripts/*.py) as modules: they are folders of scripts,
not packages, and the tests of the tooling import them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative_path: str) -> ModuleType:
    path = ROOT / relative_path
    name = "kvfleet_script_" + path.with_suffix("").as_posix().replace("/", "_").replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is being built.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_bench_script(name: str) -> ModuleType:
    return load_script(f"bench/{name}.py")
