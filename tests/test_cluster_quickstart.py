"""docs/operations.md, "From zero to a served model": the images the build makes are the ones the
kind and registry steps load or push, and the helm values it gives make the operator, the routers
and the demo's engine run exactly those. No cluster runs here; what a cluster would run is
computed from the chart (helm template) and the operator's own builders. The quickstart's curl,
wherever it is printed, answers the same every time."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.main import build_parser
from kvfleet.operator.resources import (
    Owner,
    engine_deployment,
    router_deployment,
)
from kvfleet.operator.spec import parse_spec
from tests.support.doc_commands import commands, section
from tests.support.tools import CHART, ROOT, helm

OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
SECTION = section(OPERATIONS, "From zero to a served model")
DEMO = yaml.safe_load((ROOT / "examples" / "inferenceservice-cpu-demo.yaml").read_text())


def built_images() -> set[str]:
    """What `make images` and `make image-gpu` build: images/build.sh's kvfleet/<name>:<TAG>."""
    makefile = (ROOT / "Makefile").read_text()
    names = {n for line in re.findall(r"images/build\.sh (.+)", makefile) for n in line.split()}
    build = (ROOT / "images" / "build.sh").read_text()
    tag = re.search(r'tag="\$\{TAG:-(\w+)\}"', build).group(1)  # type: ignore[union-attr]
    assert 'docker build --network host --build-arg "BASE_IMAGE=$base" -t "kvfleet/$name:$tag"' in (
        build
    )
    return {f"kvfleet/{name}:{tag}" for name in names}


def what_runs(set_args: list[str]) -> dict[str, str]:
    """The images a cluster would run with these helm arguments: the operator pod's, and the
    router and engine the operator would create for the CPU demo."""
    out = helm("template", "kvfleet", str(CHART), "--namespace", "kvfleet-system", *set_args)
    (deploy,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    ns = build_parser().parse_args(container["args"])
    config = OperatorConfig(engine_image=ns.engine_image, router_image=ns.router_image,
                            engine_cpu_image=ns.engine_cpu_image)  # fmt: skip
    spec = parse_spec(DEMO["metadata"]["name"], DEMO["spec"])
    owner = Owner(name=DEMO["metadata"]["name"], namespace="default", uid="u")
    (engine,) = engine_deployment(owner, spec, config)["spec"]["template"]["spec"]["containers"]
    (router,) = router_deployment(owner, spec, config)["spec"]["template"]["spec"]["containers"]
    return {
        "operator": container["image"],
        "router": router["image"],
        "engine": engine["image"],
        "gpu engine": ns.engine_image,
    }


def helm_installs() -> list[list[str]]:
    installs = [c for c in commands(SECTION) if c[:2] == ["helm", "install"]]
    assert len(installs) == 2, installs
    return installs


def set_values(command: list[str]) -> list[str]:
    return [a for i, a in enumerate(command) if a == "--set" or command[i - 1] == "--set"]


def test_the_kind_path_runs_the_images_it_built_and_loaded():
    built = built_images()
    assert {"kvfleet/operator:dev", "kvfleet/engine-cpu:dev"} <= built
    (load,) = [c for c in commands(SECTION) if c[:3] == ["kind", "load", "docker-image"]]
    loaded = set(load[3:])
    assert loaded <= built
    runs = what_runs(set_values(helm_installs()[0]))
    # Everything the CPU demo needs is on the nodes: the operator, its routers, the CPU engine.
    assert {runs["operator"], runs["router"], runs["engine"]} <= loaded


def test_the_registry_path_runs_the_images_it_pushed():
    built = built_images()
    tagged = {c[2]: c[3] for c in commands(SECTION) if c[:2] == ["docker", "tag"]}
    assert set(tagged) <= built
    pushed = {c[2] for c in commands(SECTION) if c[:2] == ["docker", "push"]}
    assert pushed == set(tagged.values())
    runs = what_runs(set_values(helm_installs()[1]))
    assert set(runs.values()) <= pushed
    # Each build where a spec of its kind looks for it.
    assert tagged["kvfleet/engine-cpu:dev"] == runs["engine"]
    assert tagged["kvfleet/engine-gpu:dev"] == runs["gpu engine"]


def test_the_defaults_are_the_release_images_and_the_notes_say_so():
    runs = what_runs([])
    assert all(image.startswith("ghcr.io/kvfleet/") for image in runs.values())
    assert runs["engine"] == "ghcr.io/kvfleet/engine:0.1.0-cpu"
    out = helm("install", "kvfleet", str(CHART), "--dry-run=client", "--namespace", "x")
    notes = out.split("NOTES:", 1)[1]
    assert "exist only once release v0.1.0 has been published" in notes
    assert "From zero to a served model" in notes and "From zero to a served model" in OPERATIONS
    own = helm("install", "kvfleet", str(CHART), "--dry-run=client", "--namespace", "x",
               *set_values(helm_installs()[0]))  # fmt: skip
    assert "exist only once" not in own.split("NOTES:", 1)[1]


def curls() -> list[tuple[str, str]]:
    """(where, JSON body) of every quickstart chat completion printed to a user."""
    notes = helm("install", "kvfleet", str(CHART), "--dry-run=client", "--namespace", "x")
    sources = {
        "README.md": (ROOT / "README.md").read_text(),
        "NOTES.txt": notes.split("NOTES:", 1)[1],
        "docs/operations.md": OPERATIONS,
        "examples/inferenceservice-cpu-demo.yaml": (
            ROOT / "examples" / "inferenceservice-cpu-demo.yaml"
        ).read_text(),
    }
    found = []
    for where, text in sources.items():
        text = re.sub(r"\\\n[\s#]*", " ", text)  # continuation lines, in comments too
        pattern = r"curl [^\n]*?/v1/chat/completions[^\n]*?-d '(\{.*?\})'"
        found += [(where, body) for body in re.findall(pattern, text, re.S)]
    return found


def test_every_quickstart_curl_is_deterministic_and_bounded():
    found = curls()
    assert {where for where, _ in found} == {
        "README.md",
        "NOTES.txt",
        "docs/operations.md",
        "examples/inferenceservice-cpu-demo.yaml",
    }
    for where, body in found:
        request = json.loads(body)
        assert request["model"] == "smollm2-135m-instruct", where
        assert request["temperature"] == 0, where
        assert 0 < request["max_tokens"] <= 64, where


@pytest.mark.parametrize("command", commands(SECTION), ids=lambda c: " ".join(c[:3]))
def test_the_section_names_only_files_that_exist(command):
    for word in command:
        if word.startswith(("examples/", "charts/")):
            assert (ROOT / word).exists(), word
