"""The docs stay true to the code: the CRD reference covers the schema with its defaults, the
metrics reference names exactly the engine's metrics, flags and Helm values named in the docs
exist, cited benchmark figures are in bench/RESULTS.md, and relative links resolve."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet.engine.cli import build_parser as engine_parser
from kvfleet.operator.main import build_parser as operator_parser
from kvfleet.router.main import build_parser as router_parser
from kvfleet.telemetry import metric_names

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
README = ROOT / "README.md"
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
CRD_DOC = (ROOT / "docs" / "crd.md").read_text()
# Guides written in parallel (autoscaling and routing issues): a link to them may wait for them.
PENDING = {ROOT / "docs" / "autoscaling.md", ROOT / "docs" / "routing.md"}


def test_readme_starts_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert lines[:6] == [
        "# kvfleet",
        "",
        "```sh",
        "make run    # install into .venv, then serve the OpenAI API on :8000 with the built-in "
        "default model",
        "make test   # install into .venv with dev tools, then lint and run the test suite",
        "```",
    ]


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve()
        if resolved in PENDING and not resolved.exists():
            continue
        assert resolved.exists(), f"{doc.name}: broken link {target}"
        if anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{doc.name}: no heading #{anchor} in {path}"


def _fields(node: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every field under node, by dotted path (array items and open objects end a path)."""
    out = {}
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        out[path] = sub
        if sub.get("type") == "object" and not sub.get("x-kubernetes-preserve-unknown-fields"):
            out.update(_fields(sub, f"{path}."))
    return out


def _doc_table_rows(section: str) -> list[tuple[str, ...]]:
    text = CRD_DOC.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [
        tuple(c.strip() for c in line.strip().strip("|").split("|"))
        for line in text.splitlines()
        if line.startswith("| `")
    ]


def _documented(section: str) -> set[str]:
    """Paths a table documents: `a.b`, and `a.b` / `c` or `a.b`, `c` meaning a.b and a.c."""
    names: set[str] = set()
    for row in _doc_table_rows(section):
        first, *more = re.findall(r"`([^`]+)`", row[0])
        names.add(first)
        parent = first.rpartition(".")[0]
        names.update(f"{parent}.{m}" if parent else m for m in more)
    return names


def test_crd_reference_documents_every_spec_field():
    spec = _fields(SCHEMA["properties"]["spec"])
    documented = _documented("spec")
    # An object documented as a whole ({name, key}) covers its fields.
    missing = [
        path
        for path, sub in spec.items()
        if path not in documented
        and not any(path.startswith(d + ".") for d in documented)
        and not (sub.get("type") == "object" and any(d.startswith(path + ".") for d in documented))
    ]
    assert not missing, f"docs/crd.md lacks spec fields: {missing}"
    unknown = [d for d in documented if d not in spec]
    assert not unknown, f"docs/crd.md documents fields the CRD lacks: {unknown}"


def test_crd_reference_defaults_match_the_schema():
    spec = _fields(SCHEMA["properties"]["spec"])
    checked = 0
    for row in _doc_table_rows("spec"):
        paths = re.findall(r"`([^`]+)`", row[0])
        if len(paths) != 1 or "default" not in spec[paths[0]]:
            continue
        default = spec[paths[0]]["default"]
        if isinstance(default, dict):
            continue
        if isinstance(default, bool):
            want = str(default).lower()
        else:
            want = "[]" if default == [] else str(default)
        assert want in row[1], f"docs/crd.md: {paths[0]} default {row[1]!r}, schema {want!r}"
        checked += 1
    assert checked >= 25


def test_crd_reference_documents_every_status_field():
    status = _fields(SCHEMA["properties"]["status"])
    top = {p for p in status if "." not in p}
    documented = _documented("status")
    assert top <= documented | {"conditions"}, top - documented
    assert "`conditions`" in CRD_DOC


def test_metrics_reference_names_exactly_the_engine_metrics():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    # A counter may be tabled as its series, with the _total the exposition adds.
    tabled = {
        name.removesuffix("_total")
        for name in re.findall(r"^\| `((?:vllm:|kvfleet_engine_)[a-z0-9_]+)`", doc, re.M)
    }
    assert tabled == set(metric_names.ENGINE_METRICS)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


# Flags of other tools used in the docs' commands.
OTHER_TOOLS_FLAGS = {
    "--namespace", "--create-namespace", "--reuse-values", "--server-side", "--previous",
    "--as", "--build-arg", "--set", "--dry-run", "--include-crds", "--kube-context", "--no-deps",
    "--api-version", "--recursive",
    # docker's and the hub CLI's (docs/operations.md, "Run the engine image")
    "--rm", "--env-file", "--read-only", "--user", "--cap-drop", "--security-opt", "--tmpfs",
    "--entrypoint", "--gpus", "--ipc", "--shm-size", "--time", "--local-dir", "--detach",
}  # fmt: skip


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_flags_named_in_docs_exist(doc: Path):
    known = (
        _flags(engine_parser()) | _flags(operator_parser()) | _flags(router_parser())
    ) | OTHER_TOOLS_FLAGS
    # Includes the engine's --no-x forms of boolean flags.
    text = re.sub(r"https?://\S+", "", doc.read_text())
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))
    assert not named - known, f"{doc.name} names unknown flags: {sorted(named - known)}"


def test_cited_benchmark_figures_are_in_results():
    """Every figure the README's benchmark paragraph quotes is in bench/RESULTS.md."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    readme = README.read_text()
    paragraph = readme[readme.index("([bench/RESULTS.md]") :].split("\n\n")[0]
    figures = re.findall(r"\d[\d,]*(?:\.\d+)?(?:x|%)?", paragraph)
    quoted = [f for f in figures if "," in f or "." in f or f.endswith(("x", "%"))]
    assert len(quoted) >= 4, paragraph
    for figure in quoted:
        assert figure in results, figure


def _readme_block(lang: str, after: str) -> str:
    """The first ```lang block of the README after the heading `after`."""
    text = README.read_text().split(after, 1)[1]
    block = re.search(rf"```{lang}\n(.*?)```", text, re.S)
    assert block, f"no ```{lang} block after {after}"
    return block.group(1)


def test_the_readme_engine_examples_run_as_written(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The LLM example and the generate command, verbatim, on the built-in default model (from
    the cache, as after `make run`)."""
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(smollm2_gguf.parents[1])}
    code = _readme_block("python", "## The engine")
    command = shlex.split(_readme_block("sh", "From the shell").replace("\\\n", " "))
    assert command[0] == "kvfleet-engine"
    # Both at once: each interpreter spends most of its time loading the model on one core.
    example, cli = _run_together(
        [[sys.executable, "-c", code], [sys.executable, "-m", "kvfleet.engine.cli", *command[1:]]],
        cwd=tmp_path,
        env=env,
    )
    assert example.returncode == 0, example.stderr[-2000:]
    # Two outputs, each "cached-tokens text finish-reason" (the text may hold newlines).
    assert (
        re.match(r"\d+ ", example.stdout)
        and len(re.findall(r" (?:length|stop)$", example.stdout, re.M)) >= 2
    )
    # Greedy, and the token-id prompt in the model's own vocabulary: both answers are right.
    assert "Paris" in example.stdout and "Rome" in example.stdout, example.stdout
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert cli.stdout.startswith("prompt: 'The capital of France is'"), cli.stdout


def _run_together(
    commands: list[list[str]], **popen: Any
) -> list[subprocess.CompletedProcess[str]]:
    """Each command in its own process, all at once (their output in files: a full pipe would
    stall one); their outputs once all have exited, 300 s at most, the rest killed after."""
    with contextlib.ExitStack() as files:
        outs = [
            (files.enter_context(tempfile.TemporaryFile("w+")),
             files.enter_context(tempfile.TemporaryFile("w+")))
            for _ in commands
        ]  # fmt: skip
        procs = [
            subprocess.Popen(c, stdout=out, stderr=err, text=True, **popen)
            for c, (out, err) in zip(commands, outs, strict=True)
        ]
        try:
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        results = []
        for p, code, (out, err) in zip(procs, codes, outs, strict=True):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(p.args, code, out.read(), err.read()))
        return results


def _client_examples() -> list[tuple[str, str, str]]:
    """(where, language, code) of every example that talks to a server: the README's and
    docs/api.md's Python blocks (the engine's LLM example aside) and the README's local curl."""
    found = []
    for doc in (README, ROOT / "docs" / "api.md"):
        for code in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            if "from kvfleet.engine import" not in code:
                found.append((doc.name, "python", code))
    found.append((README.name, "sh", _readme_block("sh", "## Query the local server")))
    return found


def test_the_client_examples_run_against_the_default_model(smollm2_gguf: Path) -> None:
    """Each example verbatim, but for the port (README's local and port-forwarded ones,
    :8000 and :8080, both reach one server on a free port here), against the default model
    served as `make run` serves it, each run in a fresh interpreter or shell."""
    from tests.support.servers import default_model_server

    examples = _client_examples()
    assert len(examples) == 5, [where for where, _, _ in examples]
    with default_model_server(smollm2_gguf, "smollm2-135m-instruct") as s:
        port = s.url.rsplit(":", 1)[1]
        for where, lang, code in examples:
            code = re.sub(r"localhost:80[08]0", f"127.0.0.1:{port}", code)
            command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-c", code]
            run = subprocess.run(command, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, (where, code, run.stderr[-2000:])
            # Every example asks for France's capital, a person or the weather in Paris.
            assert re.search(r"Paris|name='\w+' age=\d+", run.stdout), (where, run.stdout)
