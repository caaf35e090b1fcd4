"""The GitHub Actions workflows (.github/workflows): linted by actionlint (shellcheck on every
`run:` script), and held to what a release pipeline promises: actions pinned by commit, least
privilege, multi-arch images with provenance and SBOM attestations from the Dockerfiles that
exist, the chart pushed after its images, and a tag that must match the versions it publishes.

The workflows cannot run here (no registry is reachable); the tag check, plain bash, does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = yaml.safe_load((WORKFLOWS / "release.yaml").read_text())
CI = yaml.safe_load((WORKFLOWS / "ci.yaml").read_text())
CHART = yaml.safe_load((ROOT / "charts" / "kvfleet" / "Chart.yaml").read_text())
VALUES = yaml.safe_load((ROOT / "charts" / "kvfleet" / "values.yaml").read_text())
BIN = Path(sys.executable).parent
PINNED = re.compile(r"^[\w.-]+/[\w.-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+$")


def on(workflow: dict[str, Any]) -> dict[str, Any]:
    # YAML 1.1 reads the key `on` as True.
    return workflow[True]


def steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for job in workflow["jobs"].values() for s in job.get("steps", [])]


def step(workflow: dict[str, Any], job: str, name: str) -> dict[str, Any]:
    (found,) = [s for s in workflow["jobs"][job]["steps"] if s.get("name") == name]
    return found


def test_actionlint_finds_nothing():
    actionlint = shutil.which("actionlint", path=str(BIN))
    shellcheck = shutil.which("shellcheck", path=str(BIN))
    assert actionlint and shellcheck, "pip install -e '.[dev]' installs both"
    result = subprocess.run(
        [
            actionlint,
            "-oneline",
            f"-shellcheck={shellcheck}",
            "-pyflakes=",
            "-no-color",
            *sorted(str(p) for p in WORKFLOWS.glob("*.yaml")),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_actionlint_would_catch_a_mistake(tmp_path: Path):
    bad = (WORKFLOWS / "ci.yaml").read_text().replace("runs-on:", "run-on:")
    (tmp_path / "bad.yaml").write_text(bad)
    result = subprocess.run(
        [str(BIN / "actionlint"), "-oneline", "-shellcheck=", "-pyflakes=", "bad.yaml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 1 and "run-on" in result.stdout


@pytest.mark.parametrize("workflow", [RELEASE, CI], ids=["release", "ci"])
def test_every_action_is_pinned_to_a_commit(workflow: dict[str, Any]):
    text = (WORKFLOWS / f"{workflow['name']}.yaml").read_text()
    uses = re.findall(r"uses: (.*)$", text, re.MULTILINE)
    external = [u for u in uses if not u.startswith("./")]
    assert external
    assert [u for u in external if not PINNED.match(u)] == []


def test_least_privilege():
    assert RELEASE["permissions"] == {}
    grants = {name: job["permissions"] for name, job in RELEASE["jobs"].items()}
    writers = {name for name, grant in grants.items() if "write" in grant.values()}
    assert writers == {"images", "chart"}
    assert all(grants[name] == {"contents": "read", "packages": "write"} for name in writers)
    assert all(
        grant == {"contents": "read"} for name, grant in grants.items() if name not in writers
    )
    assert CI["permissions"] == {"contents": "read"} and "permissions" not in CI["jobs"]["test"]
    # No step keeps a token in .git/config for later steps to find.
    checkouts = [s for w in (RELEASE, CI) for s in steps(w) if "checkout" in s.get("uses", "")]
    assert checkouts and all(s["with"]["persist-credentials"] is False for s in checkouts)


def test_release_runs_on_a_version_tag_after_ci():
    assert on(RELEASE) == {"push": {"tags": ["v*"]}}
    jobs = RELEASE["jobs"]
    assert jobs["ci"]["uses"] == "./.github/workflows/ci.yaml"
    assert "workflow_call" in on(CI)
    assert set(jobs["images"]["needs"]) == {"version", "ci"}
    # The chart names the images: it goes out only once they are all pushed.
    assert "images" in jobs["chart"]["needs"]


def test_ci_runs_the_ci_script():
    (run,) = [s["run"] for s in steps(CI) if "run" in s]
    assert run == "bash .ci/run"
    python = [s for s in steps(CI) if "setup-python" in s.get("uses", "")]
    assert python[0]["with"]["python-version"] == "3.11"


def _dockerfile_targets(path: Path) -> set[str]:
    return set(re.findall(r"^FROM \S+ AS (\S+)$", path.read_text(), re.MULTILINE))


def test_images_are_multi_arch_attested_and_built_from_the_dockerfiles_there_are():
    matrix = RELEASE["jobs"]["images"]["strategy"]["matrix"]["include"]
    dockerfiles = {e["dockerfile"] for e in matrix}
    assert dockerfiles == {str(p.relative_to(ROOT)) for p in (ROOT / "images").glob("*Dockerfile")}
    for entry in matrix:
        if entry["target"]:
            assert entry["target"] in _dockerfile_targets(ROOT / entry["dockerfile"])
    platforms = {(e["image"], e["target"]): e["platforms"] for e in matrix}
    assert platforms[("operator", "")] == "linux/amd64,linux/arm64"
    assert platforms[("engine", "cpu")] == "linux/amd64,linux/arm64"
    assert platforms[("engine", "gpu")] == "linux/amd64"
    (build,) = [s for s in steps(RELEASE) if "build-push-action" in s.get("uses", "")]
    assert build["with"]["provenance"] == "mode=max"
    assert build["with"]["sbom"] is True
    assert build["with"]["push"] is True


def test_images_are_the_ones_the_chart_deploys_by_default():
    # ghcr.io/<owner>/<image>:<appVersion>: the chart's defaults, once owner is the chart's.
    matrix = RELEASE["jobs"]["images"]["strategy"]["matrix"]["include"]
    (meta,) = [s for s in steps(RELEASE) if "metadata-action" in s.get("uses", "")]
    assert (
        meta["with"]["images"] == "ghcr.io/${{ needs.version.outputs.owner }}/${{ matrix.image }}"
    )
    assert "type=semver,pattern={{version}}" in meta["with"]["tags"]
    untagged = {e["image"] for e in matrix if not e["suffix"]}
    assert {VALUES["image"]["repository"], VALUES["engine"]["image"]["repository"]} == {
        f"ghcr.io/kvfleet/{image}" for image in untagged
    }
    # The engine image without suffix is the GPU one: the chart's default engine image.
    assert [e["target"] for e in matrix if e["image"] == "engine" and not e["suffix"]] == ["gpu"]


def _check_tag(tag: str, tmp_path: Path) -> tuple[int, str]:
    script = step(RELEASE, "version", "Check the tag against the chart and the package")["run"]
    output = tmp_path / "output"
    output.write_text("")
    env = {
        "PATH": os.environ["PATH"],
        "TAG": tag,
        "GITHUB_OUTPUT": str(output),
        "GITHUB_REPOSITORY_OWNER": "KvFleet",
    }
    result = subprocess.run(
        ["bash", "-eo", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode, output.read_text() + result.stdout


def test_the_tag_must_be_the_version_it_publishes(tmp_path: Path):
    version = CHART["version"]
    assert _check_tag(f"v{version}", tmp_path) == (0, f"version={version}\nowner=kvfleet\n")
    rc, out = _check_tag("v9.9.9", tmp_path)
    assert rc == 1 and f"::error::tag v9.9.9: chart version {version}" in out


def test_chart_is_packaged_and_pushed_to_ghcr():
    script = step(RELEASE, "chart", "Package and push the chart")["run"]
    assert '"$helm" package charts/kvfleet --destination dist' in script
    assert '"$helm" push "dist/kvfleet-$VERSION.tgz" "oci://ghcr.io/$OWNER/charts"' in script
    assert "--password-stdin" in script
    assert CHART["name"] == "kvfleet"
