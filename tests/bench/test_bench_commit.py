"""The commit the benchmarks record (bench/common.py: git_commit): the checkout's HEAD, the one
KVFLEET_COMMIT names for a `git archive` copy, never a parent repository's HEAD."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.scripts import ROOT, load_bench_script, load_script

common = load_bench_script("common")


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_checkouts_head(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFLEET_COMMIT", raising=False)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    assert common.git_commit() == _git("rev-parse", "--short", "HEAD", cwd=ROOT)


def test_kvfleet_commit_names_the_code_of_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLEET_COMMIT", "0123abc")
    assert common.git_commit() == "0123abc"


def test_a_copy_inside_another_repository_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot unpacked in a folder of another checkout: that checkout's HEAD is not the
    code that runs."""
    monkeypatch.delenv("KVFLEET_COMMIT", raising=False)
    outer = tmp_path / "outer"
    (outer / "snap" / "bench").mkdir(parents=True)
    _git("init", "-q", cwd=outer)
    (outer / "f").write_text("x")
    _git("add", "f", cwd=outer)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "outer", cwd=outer)
    shutil.copy(ROOT / "bench" / "common.py", outer / "snap" / "bench" / "common.py")
    # An absolute path: load_script joins it to the repository root, which it replaces.
    copy = load_script(str(outer / "snap" / "bench" / "common.py"))
    assert copy.git_commit() == "unknown"
