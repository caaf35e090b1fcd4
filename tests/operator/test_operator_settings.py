"""`kvfleet-operator run`'s settings from its flags and KVFLEET_* variables: what an empty
variable means, and a setting the operator cannot run with refused in one line before it
starts."""

from __future__ import annotations

import logging

import pytest

from kvfleet.operator.config import OperatorConfig, RunSettings
from kvfleet.operator.main import build_parser, main
from kvfleet.telemetry.settings_flags import flag_values


def run_settings(*argv: str) -> tuple[OperatorConfig, RunSettings]:
    ns = build_parser().parse_args(["run", *argv])
    return OperatorConfig(**flag_values(ns, OperatorConfig)), RunSettings(
        **flag_values(ns, RunSettings)
    )


def test_the_defaults_are_the_shipped_images_and_no_allow_lists() -> None:
    config, run = run_settings()
    assert config == OperatorConfig()
    assert config.engine_cpu_image == config.engine_image + "-cpu"
    assert config.allowed_images is None and config.allowed_secrets is None
    assert run == RunSettings() and run.namespace == ()


def test_variables_fill_in_for_flags_not_given(monkeypatch) -> None:
    monkeypatch.setenv("KVFLEET_NAMESPACES", "a, b")
    monkeypatch.setenv("KVFLEET_ROUTER_IMAGE", "registry/operator:2")
    monkeypatch.setenv("KVFLEET_SCRAPE_TIMEOUT", "0.5")
    config, run = run_settings("--router-image", "registry/operator:3")
    assert (run.namespace, run.scrape_timeout) == (("a", "b"), 0.5)
    assert config.router_image == "registry/operator:3"
    assert run_settings("-n", "c")[1].namespace == ("c",)


def test_an_empty_variable_is_unset_but_an_empty_allow_list_allows_nothing(monkeypatch) -> None:
    for name in ("KVFLEET_ENGINE_IMAGE", "KVFLEET_PEERING", "KVFLEET_HEALTH_ADDRESS"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("KVFLEET_ALLOWED_IMAGES", "")
    monkeypatch.setenv("KVFLEET_ALLOWED_SECRETS", "")
    config, run = run_settings()
    assert config.engine_image == OperatorConfig().engine_image
    assert (run.peering, run.health_address) == (None, "0.0.0.0:8081")
    assert config.allowed_images == () and config.allowed_secrets == ()


@pytest.mark.parametrize(
    "argv,error",
    [
        (["--autoscale-interval", "0"], "--autoscale-interval 0.0: Input should be greater than 0"),
        (["--scrape-timeout", "nan"], "--scrape-timeout nan: Input should be a finite number"),
        (["--metrics-address", "0.0.0.0"], "--metrics-address: '0.0.0.0' is not HOST:PORT"),
        (["--engine-image", ""], "--engine-image: String should have at least 1 character"),
    ],
)
def test_a_setting_it_cannot_run_with_is_one_line_and_exit_2(argv, error, caplog) -> None:
    with caplog.at_level(logging.ERROR, "kvfleet.operator"):
        assert main(["run", *argv]) == 2
    assert [r.getMessage() for r in caplog.records] == [error]
