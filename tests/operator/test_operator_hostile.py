"""Issue 15, the operator's part: what an InferenceService author may not do.

* extraArgs cannot set a flag the operator manages, abbreviated or not: the operator parses them
  as the engine does (argparse, abbreviations off) from a checked copy of the engine's flags, and
  the CRD's rule refuses every prefix of a managed flag.
* The API key reaches the engine through its environment only, never its command line.
* The pods' grace period and the engine's --shutdown-timeout come from one number.
* Opt-in allow-lists for images and Secrets: a violating spec is not applied and is Degraded.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

from kvfleet.operator import engine_flags
from kvfleet.operator.admission import image_allowed, image_repository, policy_violations
from kvfleet.operator.command_lines import engine_args
from kvfleet.operator.config import OperatorConfig
from kvfleet.operator.engine_flags import SERVE_FLAGS, ExtraArgsError, given_flags
from kvfleet.operator.resources import (
    PRESTOP_SLEEP_SECONDS,
    SHUTDOWN_MARGIN_SECONDS,
    Owner,
    build_children,
)
from kvfleet.operator.spec import (
    MANAGED_FLAGS,
    MSG_MANAGED_FLAGS,
    SpecError,
    managed_flag_pattern,
    parse_spec,
)
from kvfleet.operator.status import Observed, Problem, compute_status, transition_events
from kvfleet.telemetry.ports import ENGINE_PORT
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvfleet.dev.yaml").read_text())
ENGINE_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
    "properties"
]["engine"]
OWNER = Owner(name="llm", namespace="team-a", uid="u")
CONFIG = OperatorConfig(engine_image="registry/engine:1", router_image="registry/operator:1")
NOW = datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC)
# The issue's bypass: argparse abbreviations of --api-key, --host and --port.
ABBREVIATED = ["--api", "k", "--hos", "0.0.0.0", "--por", "9999"]


def cel_accepts(extra_args: list[str]) -> bool:
    """The CRD's extraArgs rule, evaluated as the API server would (cel-python uses RE2 too)."""
    (rule,) = ENGINE_SCHEMA["x-kubernetes-validations"]
    env = celpy.Environment()
    program = env.program(env.compile(rule["rule"]))
    assert rule["message"] == MSG_MANAGED_FLAGS
    # After changing MANAGED_FLAGS, paste managed_flag_pattern() into the rule.
    assert f"!a.matches('{managed_flag_pattern()}')" in rule["rule"]
    return bool(program.evaluate({"self": celpy.json_to_cel({"extraArgs": extra_args})}))


def spec_error(extra_args: list[str]) -> str | None:
    try:
        parse_spec("llm", {"engine": {"extraArgs": extra_args}})
    except SpecError as e:
        return str(e)
    return None


def engine_container(spec_raw: dict[str, Any]) -> dict[str, Any]:
    children = build_children(OWNER, parse_spec("llm", spec_raw), CONFIG)
    deploy = next(
        c for c in children if c["kind"] == "Deployment" and "engine" in c["metadata"]["name"]
    )
    return deploy["spec"]["template"]["spec"]["containers"][0]


# --- extraArgs --------------------------------------------------------------------------------


def test_the_flag_table_is_the_engines():
    """Fails when the engine gained, lost or changed a flag: regenerate the table with
    `.venv/bin/python scripts/update_engine_flags.py`."""
    update = load_script("scripts/update_engine_flags.py")
    current = update.engine_serve_flags()
    missing = {f: n for f, n in current.items() if SERVE_FLAGS.get(f, "absent") != n}
    extra = {f: n for f, n in SERVE_FLAGS.items() if f not in current}
    assert not missing and not extra, (
        f"engine_flags.SERVE_FLAGS is out of date: the engine has {missing}, the table has "
        f"{extra} too many; regenerate:\n{update.render_table(current)}"
    )


def test_abbreviated_managed_flags_are_refused_by_the_operator_and_the_crd():
    assert not cel_accepts(ABBREVIATED)
    message = spec_error(ABBREVIATED)
    assert message is not None and MSG_MANAGED_FLAGS in message
    assert "'--api'" in message and "'--hos'" in message and "'--por'" in message
    for arg in ("--por=9999", "--api-key-f=/k", "--served=x", "--shut", "--help", "-h", "--"):
        assert not cel_accepts([arg]), arg
        assert MSG_MANAGED_FLAGS in (spec_error([arg]) or ""), arg


def test_every_prefix_of_every_managed_flag_is_refused():
    for flag in MANAGED_FLAGS:
        for end in range(2, len(flag) + 1):
            for arg in (flag[:end], f"{flag[:end]}=x"):
                assert not cel_accepts([arg]), arg
                assert MSG_MANAGED_FLAGS in (spec_error([arg]) or ""), arg


def test_no_allowed_flag_is_a_prefix_of_a_managed_one():
    """Else the CRD's prefix rule would refuse a flag the engine accepts."""
    allowed = [f for f in SERVE_FLAGS if f not in MANAGED_FLAGS]
    assert allowed
    for flag in allowed:
        assert cel_accepts([flag]) and cel_accepts([f"{flag}=1"]), flag


def test_every_flag_the_operator_sets_is_managed():
    raw = {
        "model": {"source": "/m"},
        "resources": {"gpus": 2},
        "engine": {"maxModelLen": 8, "maxWaitingRequests": 4, "tensorParallelSize": 2},
        "apiKeySecretRef": {"name": "k"},
    }
    for spec in (parse_spec("llm", raw), parse_spec("llm", {"engine": {"enablePrefixCaching": 0}})):
        set_by_operator = [
            a for a in engine_args(spec, "/m", port=ENGINE_PORT) if a.startswith("-")
        ]
        assert set(set_by_operator) <= set(MANAGED_FLAGS)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["/models/other"], "unrecognized arguments: /models/other"),
        (["--seed"], "--seed: expected one argument"),
        (["--seed", "--enforce-eager"], "--seed: expected one argument"),
        (["--enforce-eager=yes"], "ignored explicit argument"),
        # Abbreviations of flags the operator does not manage: the engine refuses them too.
        (["--enforce"], "unrecognized arguments: --enforce"),
        (["--num-gpu-blocks", "8"], "unrecognized arguments: --num-gpu-blocks 8"),
    ],
)
def test_arguments_the_engine_would_refuse_are_refused(args, words):
    message = spec_error(args)
    assert message is not None and "spec.engine" in message and words in message
    with pytest.raises(ExtraArgsError):
        given_flags(args)


def test_arguments_the_engine_accepts_pass():
    args = ["--seed", "-1", "--enforce-eager", "--no-skip-tokenizer-init", "--load-format=auto"]
    assert spec_error(args) is None and cel_accepts(args)
    assert given_flags(args) == ["--seed", "--enforce-eager", "--no-skip-tokenizer-init",
                                 "--load-format"]  # fmt: skip
    command = engine_container({"engine": {"extraArgs": args}})["args"]
    assert command[-len(args) :] == args


def test_the_operator_parser_has_abbreviations_off():
    parser = engine_flags.build_parser()
    assert parser.allow_abbrev is False and parser.exit_on_error is False


# --- the API key ------------------------------------------------------------------------------


def test_the_api_key_is_never_on_the_command_line():
    engine = engine_container({"apiKeySecretRef": {"name": "keys", "key": "k"}})
    command_line = [*engine.get("command", []), *engine["args"]]
    assert not [a for a in command_line if "api-key" in a or "API_KEY" in a]
    (env,) = [e for e in engine["env"] if e["name"] == "KVFLEET_API_KEY"]
    assert env == {
        "name": "KVFLEET_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "keys", "key": "k"}},
    }


# --- the grace period -------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, 30, 45, 3600])
def test_grace_period_and_shutdown_timeout_are_one_number(timeout):
    spec = parse_spec("llm", {"engine": {"shutdownTimeoutSeconds": timeout}})
    children = {c["metadata"]["name"]: c for c in build_children(OWNER, spec, CONFIG)}
    engine_pod = children["llm-engine"]["spec"]["template"]["spec"]
    args = engine_pod["containers"][0]["args"]
    assert args[args.index("--shutdown-timeout") + 1] == str(timeout)
    grace = PRESTOP_SLEEP_SECONDS + timeout + SHUTDOWN_MARGIN_SECONDS
    assert engine_pod["terminationGracePeriodSeconds"] == grace
    router_pod = children["llm-router"]["spec"]["template"]["spec"]
    assert router_pod["terminationGracePeriodSeconds"] == grace
    # The number cannot be changed behind the operator's back.
    assert MSG_MANAGED_FLAGS in (spec_error(["--shutdown-timeout", "99999"]) or "")


def test_shutdown_timeout_bounds():
    for bad in (-1, 3601):
        with pytest.raises(SpecError):
            parse_spec("llm", {"engine": {"shutdownTimeoutSeconds": bad}})
    assert parse_spec("llm", {}).engine.shutdown_timeout_seconds == 30


# --- allow-lists ------------------------------------------------------------------------------


def test_image_repository():
    assert image_repository("ghcr.io/kvfleet/engine:0.1.0") == "ghcr.io/kvfleet/engine"
    assert image_repository("registry:5000/ml/engine") == "registry:5000/ml/engine"
    assert image_repository("registry:5000/ml/engine:v2@sha256:ab") == "registry:5000/ml/engine"
    assert image_repository("engine@sha256:ab") == "engine"


def test_image_allowed_by_repository_or_folder():
    allowed = ("registry.example.com/ml/", "ghcr.io/kvfleet/engine")
    assert image_allowed("registry.example.com/ml/engine:1", allowed)
    assert image_allowed("registry.example.com/ml/team/x@sha256:ab", allowed)
    assert image_allowed("ghcr.io/kvfleet/engine:dev", allowed)
    # Not a plain string prefix: the folder and the repository end where they end.
    assert not image_allowed("registry.example.com/ml-evil/engine:1", allowed)
    assert not image_allowed("ghcr.io/kvfleet/engine-evil:1", allowed)
    assert not image_allowed("registry.example.com/ml", allowed)
    assert not image_allowed("docker.io/attacker/engine:1", allowed)


def test_no_allow_lists_allow_anything():
    spec = parse_spec(
        "llm",
        {
            "engine": {
                "image": "docker.io/attacker/x:1",
                "env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "db", "key": "p"}}}],
            },
            "routing": {"image": "docker.io/attacker/y:1"},
        },
    )
    assert policy_violations(spec, CONFIG) == []


def test_images_outside_the_allow_list_are_refused():
    config = OperatorConfig(
        engine_image="registry/engine:1",
        router_image="registry/operator:1",
        allowed_images=("ok/",),
    )
    for raw, field in (
        ({"engine": {"image": "docker.io/attacker/x:1"}}, "spec.engine.image"),
        ({"routing": {"image": "docker.io/attacker/y:1"}}, "spec.routing.image"),
    ):
        (v,) = policy_violations(parse_spec("llm", raw), config)
        assert v.reason == "ImageNotAllowed" and field in v.message and "attacker" in v.message
    for raw in (
        {},
        {"engine": {"image": "ok/engine:2"}, "routing": {"image": "ok/router:2"}},
        # The operator's own defaults are always allowed.
        {"engine": {"image": "registry/engine:1"}, "routing": {"image": "registry/operator:1"}},
    ):
        assert policy_violations(parse_spec("llm", raw), config) == []
    nothing = OperatorConfig(
        engine_image="registry/engine:1", router_image="registry/operator:1", allowed_images=()
    )
    assert policy_violations(parse_spec("llm", {}), nothing) == []
    assert policy_violations(parse_spec("llm", {"engine": {"image": "ok/e:1"}}), nothing)


def test_secrets_outside_the_allow_list_are_refused():
    config = OperatorConfig(engine_image="e", router_image="r", allowed_secrets=("api-keys",))
    raw = {
        "model": {"source": "hf://org/m", "hfTokenSecretRef": {"name": "hf"}},
        "engine": {
            "env": [
                {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "p"}}},
                {"name": "OK", "valueFrom": {"secretKeyRef": {"name": "api-keys", "key": "p"}}},
                {"name": "CM", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "k"}}},
                {"name": "F", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            ]
        },
        "apiKeySecretRef": {"name": "api-keys"},
        "adapters": [
            {"name": "a", "source": "hf://org/a", "hfTokenSecretRef": {"name": "tenant-a"}},
            {"name": "b", "source": "hf://org/b", "hfTokenSecretRef": {"name": "api-keys"}},
        ],
    }
    found = policy_violations(parse_spec("llm", raw), config)
    assert [v.reason for v in found] == ["SecretNotAllowed"] * 3
    assert "spec.engine.env[DB].valueFrom.secretKeyRef" in found[0].message
    assert "'db-password'" in found[0].message
    assert "spec.model.hfTokenSecretRef" in found[1].message
    assert "spec.adapters[a].hfTokenSecretRef" in found[2].message
    none = OperatorConfig(engine_image="e", router_image="r", allowed_secrets=())
    assert [v.reason for v in policy_violations(parse_spec("llm", raw), none)] == [
        "SecretNotAllowed"
    ] * 6


def test_a_refused_spec_is_degraded_with_its_reason_and_a_warning():
    refused = [Problem("ImageNotAllowed", "spec.engine.image 'x' is not allowed")]
    obs = Observed(generation=2, selector="s", previous={}, refused=refused)
    status = compute_status(obs, NOW)
    cond = {c["type"]: c for c in status["conditions"]}
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "ImageNotAllowed")
    assert "spec.engine.image" in cond["Degraded"]["message"]
    assert (cond["Progressing"]["status"], cond["Progressing"]["reason"]) == (
        "False",
        "ImageNotAllowed",
    )
    assert cond["Ready"]["status"] == "False"
    events = transition_events([], status["conditions"])
    assert any(e.type == "Warning" and e.reason == "ImageNotAllowed" for e in events)
