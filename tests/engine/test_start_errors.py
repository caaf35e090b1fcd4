"""Every way `kvfleet-engine` can fail to start is one line that names the file or the flag, says
what is wrong and what to do, without a traceback: exit 2, as argparse's usage errors, which print
the subcommand's one-line usage before it. Sizes in bytes take units on every *-bytes flag."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.engine.cli import build_parser, main
from tests.support.gguf_files import write_gguf
from tests.support.logs import captured_logs
from tests.support.tiny_model import tiny_model_path

SERVE = ["serve", "--host", "127.0.0.1", "--port", "0"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """main(argv)'s exit status and the lines it wrote to stderr (its log included)."""
    with captured_logs():  # main sets up logging to stderr; this puts pytest's back after
        try:
            code = main(argv)
        except SystemExit as e:
            assert isinstance(e.code, int), e.code  # argparse's and main's: a status
            code = e.code
    return code, capsys.readouterr().err.splitlines()


def _one_error(argv: list[str], capsys: pytest.CaptureFixture[str], *parts: str) -> str:
    code, lines = _run(argv, capsys)
    errors = [line for line in lines if " ERROR " in line]
    assert code == 2 and len(errors) == 1, lines
    assert "Traceback" not in "\n".join(lines)
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_model_path(), tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0")


def test_a_path_that_does_not_exist(tmp_path, capsys) -> None:
    missing = tmp_path / "no-such-model"
    line = _one_error([*SERVE, "--model", str(missing)], capsys, f"{missing} does not exist")
    assert "config.json" in line and ".gguf" in line  # what to pass instead


def test_a_hub_id_is_not_downloaded_and_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_error(
        [*SERVE, "meta-llama/Llama-3-8B"], capsys, "meta-llama/Llama-3-8B does not exist"
    )
    assert "does not download" in line
    assert "hf download meta-llama/Llama-3-8B --local-dir DIR" in line and "--model DIR" in line


def test_a_directory_without_a_model(tmp_path, capsys) -> None:
    (tmp_path / "README").write_text("weights elsewhere\n")
    _one_error([*SERVE, "--model", str(tmp_path)], capsys, f"{tmp_path} holds neither")


def test_a_text_file_named_gguf(tmp_path, capsys) -> None:
    fake = tmp_path / "x.gguf"
    fake.write_text("not weights\n")
    _one_error([*SERVE, "--model", str(fake)], capsys, str(fake), "is not a GGUF file")


def test_a_truncated_gguf(tiny_gguf, tmp_path, capsys) -> None:
    for size in (100, 20_000, tiny_gguf.stat().st_size // 2):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(tiny_gguf.read_bytes()[:size])
        line = _one_error([*SERVE, "--model", str(cut)], capsys, cut.name, "truncated or corrupt")
        assert "larger dtype" not in line and "reshape" not in line


def test_a_tokenizer_that_is_not_there(tiny_gguf, tmp_path, capsys) -> None:
    missing = tmp_path / "no-tokenizer"
    argv = [*SERVE, "--model", str(tiny_gguf), "--tokenizer", str(missing)]
    _one_error(argv, capsys, f"tokenizer {missing} is not a directory", "--tokenizer")


def test_max_model_len_past_the_models_says_the_limit_and_what_to_do(capsys) -> None:
    argv = [*SERVE, "--model", str(tiny_model_path()), "--max-model-len", "16384"]
    _one_error(argv, capsys, "--max-model-len 16384", "2048 tokens", "pass 2048 or less")


def test_a_setting_out_of_range_names_its_flag_and_value(capsys) -> None:
    _one_error(
        [*SERVE, "--model", str(tiny_model_path()), "--max-num-seqs", "0"],
        capsys,
        "--max-num-seqs 0: ",
        "greater than 0",
    )


def test_an_api_key_file_that_cannot_be_read(tmp_path, capsys) -> None:
    missing = tmp_path / "key"
    argv = [*SERVE, "--api-key-file", str(missing)]
    _one_error(argv, capsys, f"--api-key-file {missing}: cannot read it")


# -- usage errors ------------------------------------------------------------------------------


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line of a usage error, after the usage line of the subcommand argv names."""
    code, lines = _run(argv, capsys)
    assert code == 2 and len(lines) == 2, lines
    usage, error = lines
    assert usage.startswith(f"usage: kvfleet-engine {argv[0]} "), usage
    assert error.startswith(f"kvfleet-engine {argv[0]}: error: "), error
    return error


@pytest.mark.parametrize(
    "argv,near",
    [
        (["serve", "--max-num-seq", "4"], "--max-num-seqs"),
        (["serve", "--max-num-seqs=4", "--prot", "80"], "--port"),
        (["generate", "--prompt", "hi", "--max-token", "3"], "--max-tokens"),
    ],
)
def test_a_misspelt_flag_gets_its_subcommands_usage_and_the_nearest_flag(argv, near, capsys):
    error = _usage_error(argv, capsys)
    assert f"(did you mean {near}?)" in error, error


def test_an_unknown_argument_with_nothing_near_is_named(capsys) -> None:
    error = _usage_error(["serve", "--zzzzzz"], capsys)
    assert "unrecognized argument: --zzzzzz;" in error and "did you mean" not in error


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "kvfleet-engine", "serve", "--port", "80"],
        ["serve", "serve"],
        ["serve", "generate", "--prompt", "hi"],
    ],
)
def test_a_command_given_as_the_model_says_what_the_image_expects(argv, capsys) -> None:
    """`docker run IMAGE kvfleet-engine serve ...` hands the image's entrypoint, kvfleet-engine
    serve, a command where the model goes."""
    error = _usage_error(argv, capsys)
    assert f"MODEL {argv[1]!r} is a command, not a model" in error, error
    assert "docker run --entrypoint kvfleet-engine IMAGE" in error


def _size_flags(command: str) -> list[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = sub.choices[command]
    return [s for a in parser._actions for s in a.option_strings if s.endswith("-bytes")]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_bytes_flag_takes_units(command: str) -> None:
    flags = _size_flags(command)
    assert "--kv-cache-memory-bytes" in flags
    start = ["--prompt", "hi"] if command == "generate" else []
    for flag in flags:
        dest = flag.removeprefix("--").replace("-", "_")
        for given, size in (("1Gi", 1 << 30), ("512MB", 512_000_000), ("4G", 4 * 10**9),
                            ("1048576", 1 << 20)):  # fmt: skip
            ns = build_parser().parse_args([command, *start, flag, given])
            assert getattr(ns, dest) == size, (flag, given)


@pytest.mark.parametrize("flag", _size_flags("serve"))
def test_a_bad_size_is_one_line_naming_the_flag_and_the_forms(flag: str, capsys) -> None:
    error = _usage_error(["serve", flag, "1Gx"], capsys)
    assert f"argument {flag}: '1Gx' is not a size" in error
    assert "Ki, Mi, Gi, Ti" in error and "e.g. 4Gi, 512MB" in error


def test_a_start_error_is_one_line_of_the_process_and_nothing_else(tmp_path) -> None:
    """As a terminal sees it: stderr holds the error's one line, and no traceback."""
    missing = tmp_path / "nothing-here"
    run = subprocess.run(
        [sys.executable, "-m", "kvfleet.engine.cli", *SERVE, "--model", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    (line,) = run.stderr.splitlines()
    assert " ERROR " in line and f"{missing} does not exist" in line, run.stderr
