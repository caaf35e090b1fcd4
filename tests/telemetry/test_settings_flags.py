"""Flags built from a settings model (kvfleet.telemetry.settings_flags), as the engine, the
router and the operator build theirs: types, defaults as given, environment variables, lists,
settings only code sets, and errors that name the flag."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field, ValidationError

from kvfleet.protocol.byte_size import FORMS, ByteSize
from kvfleet.telemetry.settings_flags import (
    COMMA_LIST,
    Flag,
    add_model_flags,
    flag_values,
    one_line,
)


class Settings(BaseModel):
    path: str = Field(description="a path nothing defaults")
    retries: Annotated[int, Flag(env="TEST_RETRIES")] = Field(default=3, ge=0, description="n")
    mode: Literal["fast", "safe"] = Field(default="safe", description="how")
    verbose: bool = Field(default=False, description="say more")
    names: list[str] | None = Field(default=None, description="names; default: none")
    size: ByteSize = Field(default=16 << 20, ge=1024, description="a size")
    hosts: Annotated[tuple[str, ...], COMMA_LIST, Flag(env="TEST_HOSTS", short="-H")] = Field(
        default=(), description="hosts"
    )
    allowed: Annotated[tuple[str, ...] | None, COMMA_LIST, Flag(env="TEST_ALLOWED")] = Field(
        default=None, description="allowed; default: anything"
    )
    region: Annotated[str, Flag(env="TEST_REGION")] = Field(default="eu", description="where")
    probe: Annotated[float, Flag(on_command_line=False)] = 5.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="test", exit_on_error=False)
    add_model_flags(p, Settings, "settings")
    return p


def settings(*argv: str) -> Settings:
    return Settings(**flag_values(parser().parse_args(["--path", "p", *argv]), Settings))


def help_of(flag: str) -> str:
    p = parser()
    (action,) = [a for a in p._actions if flag in a.option_strings]
    return " ".join(p._get_formatter()._expand_help(action).split())


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TEST_RETRIES", "TEST_HOSTS", "TEST_ALLOWED", "TEST_REGION"):
        monkeypatch.delenv(name, raising=False)


def test_each_field_is_the_flag_of_its_name_with_its_type_and_default() -> None:
    s = settings()
    assert (s.retries, s.mode, s.verbose, s.names, s.size) == (3, "safe", False, None, 16 << 20)
    s = settings("--retries", "5", "--mode", "fast", "--verbose", "--names", "a", "b",
                 "--size", "2Mi")  # fmt: skip
    assert (s.retries, s.mode, s.verbose, s.names, s.size) == (5, "fast", True, ["a", "b"], 2 << 20)
    assert settings("--no-verbose").verbose is False
    assert help_of("--size") == f"a size; {FORMS} (default: 16Mi)"
    assert help_of("--names") == "names; default: none"  # no default to show: said in words
    assert "--probe" not in parser().format_help() and settings().probe == 5.0


def test_a_bad_value_names_its_flag() -> None:
    with pytest.raises(argparse.ArgumentError, match="argument --size: '8 megs' is not a size"):
        parser().parse_args(["--size", "8 megs"])
    with pytest.raises(argparse.ArgumentError, match="argument --mode: invalid choice"):
        parser().parse_args(["--mode", "slow"])
    with pytest.raises(ValidationError) as e:
        settings("--retries", "-1")
    assert one_line(e.value) == "--retries -1: Input should be greater than or equal to 0"


def test_an_environment_variable_is_the_default_help_shows(monkeypatch) -> None:
    monkeypatch.setenv("TEST_RETRIES", "7")
    monkeypatch.setenv("TEST_REGION", "us")
    assert (settings().retries, settings().region) == (7, "us")
    assert settings("--retries", "1").retries == 1  # the flag wins
    assert help_of("--retries") == "n (env TEST_RETRIES) (default: 7)"
    monkeypatch.setenv("TEST_RETRIES", "many")
    with pytest.raises(argparse.ArgumentError, match="argument --retries: invalid int value"):
        parser().parse_args(["--path", "p"])


def test_an_empty_variable_is_unset_but_for_a_list_where_it_is_empty(monkeypatch) -> None:
    monkeypatch.setenv("TEST_REGION", "")
    monkeypatch.setenv("TEST_ALLOWED", "")
    s = settings()
    assert s.region == "eu"  # the field's own default
    assert s.allowed == ()  # not None: the empty list allows nothing
    monkeypatch.delenv("TEST_ALLOWED")
    assert settings().allowed is None


def test_a_list_is_comma_separated_and_repeatable(monkeypatch) -> None:
    assert settings().hosts == ()
    assert settings("-H", "a, b,,", "--hosts", "c").hosts == ("a", "b", "c")
    assert settings("--allowed", "").allowed == ()
    monkeypatch.setenv("TEST_HOSTS", "x,y")
    assert settings().hosts == ("x", "y")
    assert settings("-H", "a").hosts == ("a",)  # given flags replace the variable's list
    assert help_of("--hosts") == "hosts (env TEST_HOSTS) (default: x,y)"
