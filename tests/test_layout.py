"""The repository's structure: who may import whom, no folder that shadows a module when Python
runs from the repository root, and a wheel that carries every module."""

from __future__ import annotations

import ast
import site
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "operator", "router", "protocol", "telemetry")

# What each package may import of the project (itself always). protocol is the small module
# the engine's server and the router share: the wire format's bounds, chat rendering. telemetry
# is what all three processes share: the log format, trace set-up, the names of the metrics one
# exports and another reads, the ports they listen on, and how settings become flags.
ALLOWED = {
    "kernels": set(),
    "protocol": set(),
    "telemetry": set(),
    "engine": {"kernels", "protocol", "telemetry"},
    "router": {"protocol", "telemetry"},
    "operator": {"telemetry"},
}


def _imported_names(path: Path) -> set[str]:
    """Every dotted name a module imports (``from a.b import c`` gives a.b and a.b.c), lazily
    inside functions and under TYPE_CHECKING included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _project_imports(path: Path) -> set[str]:
    """The kvfleet packages a module imports."""
    return {
        parts[1]
        for name in _imported_names(path)
        if (parts := name.split("."))[0] == "kvfleet" and len(parts) > 1
    }


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("kvfleet", *(parts[:-1] if parts[-1] == "__init__" else parts)))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering(package: str) -> None:
    assert _modules(package), f"{package}/ holds no module"
    broken = {
        str(path.relative_to(ROOT)): sorted(imported)
        for path in _modules(package)
        if (imported := _project_imports(path) - ALLOWED[package] - {package})
    }
    assert not broken, f"{package} may import only {sorted(ALLOWED[package])}: {broken}"


def test_no_module_imports_the_tests_or_the_benches() -> None:
    """Test fixtures (tests/support: the tiny models, the emulators) and the benchmarks ship in
    no wheel: a package that imported them would fail where it is installed."""
    broken = {
        str(path.relative_to(ROOT)): sorted(outside)
        for package in PACKAGES
        for path in _modules(package)
        if (outside := {n for n in _imported_names(path) if n.split(".")[0] in ("tests", "bench")})
    }
    assert not broken, broken


def test_every_module_serves_a_process_or_the_public_api() -> None:
    """Every module of the six packages is imported, directly or through others, by a command's
    entry point (pyproject.toml's scripts) or the engine's public API (kvfleet.engine): what
    only tests or benchmarks use lives in tests/support, not in what a deployment installs."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    modules = {_module_name(p): p for package in PACKAGES for p in _modules(package)}
    todo = ["kvfleet.engine", *(target.split(":")[0] for target in scripts.values())]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached or name not in modules:
            continue
        reached.add(name)
        for imported in _imported_names(modules[name]):
            parts = imported.split(".")
            todo.extend(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    unreached = sorted(set(modules) - reached)
    assert not unreached, f"imported by no process nor the public API: {unreached}"


def test_the_rule_check_sees_lazy_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "def f():\n    from kvfleet.engine.cli import main\n    import kvfleet.router.main\n"
    )
    assert _project_imports(module) == {"engine", "router"}


def _attribute_reads(path: Path, name: str) -> list[int]:
    """The lines where a module reads an attribute of this name, of whatever object."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == name
    )


def test_the_server_reaches_the_engine_only_through_its_async_facade() -> None:
    """The engine's server uses AsyncEngine's public members, each of which says which thread
    may call it; the EngineCore behind it belongs to the engine thread, so no server module
    reads an engine's `.core` (the server builds one, in create_engine, before any thread)."""
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "engine" / "server").rglob("*.py"))
        if (lines := _attribute_reads(path, "core"))
    }
    assert not found, f"server modules reach past AsyncEngine into .core (lines): {found}"


def test_the_facade_rule_sees_any_core_attribute(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(ctx):\n    x = ctx.engine.core\n    return x.tokenizer, core\n")
    assert _attribute_reads(module, "core") == [2]


@pytest.mark.parametrize(
    "code",
    [
        "import collections, operator; assert operator.__file__.endswith('/operator.py')",
        "import kernels; assert kernels.__file__ is None",  # a namespace portion, never a module
    ],
)
def test_nothing_shadows_a_module_from_the_repository_root(code: str) -> None:
    # No isolation flag: the repository root is on sys.path, as for `python -m pytest`.
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    tool = subprocess.run(
        [sys.executable, "-m", "json.tool"], input="{}", cwd=ROOT, capture_output=True, text=True
    )
    assert tool.returncode == 0 and tool.stdout.strip() == "{}", tool.stderr


def test_the_wheel_carries_every_module(tmp_path: Path) -> None:
    """A plain (non-editable) install gets every module of every package: nothing is listed by
    hand, so a new subpackage cannot be left out."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("kvfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"kvfleet/{p.relative_to(ROOT).as_posix()}"
        for package in PACKAGES
        for p in _modules(package)
    }
    assert expected <= names, sorted(expected - names)


def test_static_tools_find_every_module_of_the_dev_install() -> None:
    """Editors and type checkers resolve imports from the directories .pth files list, never by
    running an import hook: every kvfleet module must be a file under such a directory (the
    strict editable install's link tree), as for pyright, which resolves them all."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    roots = [
        Path(line.strip())
        for pth in purelib.glob("*.pth")
        for line in pth.read_text().splitlines()
        if line.strip() and not line.startswith(("import", "#"))
    ]
    assert any((root / "kvfleet").is_dir() for root in roots), (
        f"kvfleet is not a strict editable install in {site.PREFIXES} (make install-dev)"
    )
    missing = [
        p.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for p in _modules(package)
        if not any((root / "kvfleet" / p.relative_to(ROOT)).is_file() for root in roots)
    ]
    assert not missing, f"not visible to static tools (run make install): {missing}"


def test_the_engine_imports_neither_triton_nor_torch_compile() -> None:
    """Triton is a GPU dependency the CPU install does not carry, and on the CPU the kernels
    run only in Triton's interpreter, which must be switched on before Triton is imported:
    importing the engine and its server (the default model's path) must not import it, nor
    torch.compile's machinery (seconds of start-up that brings Triton with it)."""
    code = (
        "import sys, kvfleet.engine, kvfleet.engine.server.app, kvfleet.engine.cli; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'triton'}), "
        "'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.split() == ["[]", "False"], out


def test_a_test_module_that_needs_no_model_starts_without_torch_or_kmock() -> None:
    """Collecting the protocol's tests loads neither torch, transformers nor the Kubernetes
    emulator: conftest's fixtures import what they use when they run, and the plugins nothing
    uses are off (pyproject.toml), so such a module's first test starts within a second or two
    rather than after ~12 s of imports."""
    heavy = ("torch", "transformers", "kmock", "langsmith")
    module = "tests/protocol/test_json_body.py"
    code = (
        "import sys, pytest\n"
        f"pytest.main(['-q', '--co', '-p', 'no:cacheprovider', {module!r}])\n"
        f"print([m for m in {heavy!r} if m in sys.modules])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout[-2000:]
