"""The log format, the request id's rules, the three CLIs' flags, the one-line error when traces
are asked for without the SDK, and no OpenTelemetry import unless they are."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kvfleet.engine.cli import build_parser as engine_parser
from kvfleet.engine.cli import main as engine_main
from kvfleet.router.main import main as router_main
from kvfleet.router.main import parse_args as router_args
from kvfleet.telemetry.logs import REQUEST_ID, request_id_from
from kvfleet.telemetry.tracing import OTLP_TRACES_ENV, Tracing, tracing_from
from tests.support.logs import captured_logs, json_lines

ENDPOINT = "http://127.0.0.1:4318/v1/traces"
SDK_EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def test_a_json_line_has_the_fields_a_log_pipeline_reads():
    log = logging.getLogger("kvfleet.test")
    with captured_logs("json") as stream:
        log.info("plain %s", "line")
        token = REQUEST_ID.set("r-42")
        try:
            raise RuntimeError("boom\non two lines")
        except RuntimeError:
            log.exception("failed")
        finally:
            REQUEST_ID.reset(token)
        log.warning("about an object", extra={"k8s_ref": {"name": "x"}, "settings": object()})
    plain, failed, kopf_like = json_lines(stream)
    assert plain["message"] == "plain line" and plain["level"] == "INFO"
    assert plain["logger"] == "kvfleet.test" and plain["time"].endswith("+00:00")
    assert "request_id" not in plain and "exception" not in plain
    assert failed["request_id"] == "r-42" and failed["level"] == "ERROR"
    assert "RuntimeError: boom\non two lines" in failed["exception"]
    # kopf's object reference is kept; its settings object (not JSON) is not.
    assert kopf_like["object"] == {"name": "x"} and "settings" not in kopf_like


def test_text_stays_the_default_and_one_line_per_event():
    with captured_logs("text") as stream:
        logging.getLogger("kvfleet.test").info("hello")
    assert stream.getvalue().rstrip().endswith("INFO kvfleet.test: hello")


@pytest.mark.parametrize(
    ("given", "taken"),
    [("abc-123", True), ("0af7651916cd43dd:1", True), ("a\nb", False), ("", False),
     ("x" * 129, False), ("é", False), (None, False)],
)  # fmt: skip
def test_a_client_request_id_is_taken_only_when_plain(given, taken):
    made = request_id_from(given)
    assert (made == given) is taken
    if not taken:
        assert len(made) == 32 and made.isalnum()


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-format", "json", "--log-level", "debug", "serve"],
        ["serve", "--log-format", "json", "--log-level", "DEBUG"],
    ],
)
def test_engine_log_flags_go_before_or_after_the_subcommand(argv):
    ns = engine_parser().parse_args(argv)
    assert (ns.log_format, ns.log_level) == ("json", "DEBUG")
    assert engine_parser().parse_args(["serve"]).log_format == "text"


def test_bad_log_flags_are_refused_by_each_cli(capsys):
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["serve", "--log-format", "xml"])
    assert "invalid choice: 'xml'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router_args(["--endpoints", "127.0.0.1:1", "--log-level", "LOUD"])
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_the_environment_endpoint_turns_tracing_on(monkeypatch):
    assert tracing_from(None, "router") is None
    monkeypatch.setenv(OTLP_TRACES_ENV, ENDPOINT)
    tracing = tracing_from(None, "router")
    assert isinstance(tracing, Tracing)
    tracing.shutdown()
    with pytest.raises(ValueError, match="must be an http"):
        tracing_from("collector:4317", "router")


def test_without_the_sdk_an_endpoint_is_one_clear_error(monkeypatch, model_dirs, capsys):
    monkeypatch.setitem(sys.modules, SDK_EXPORTER, None)  # as if the extra were not installed
    argv = ["serve", "--model", str(model_dirs["llama"]), "--otlp-traces-endpoint", ENDPOINT,
            "--log-format", "json"]  # fmt: skip
    # captured_logs: what main sets up (to stderr) is undone after.
    with captured_logs():
        assert engine_main(argv) == 2
    (line,) = [json.loads(s) for s in capsys.readouterr().err.splitlines()]
    assert line["level"] == "ERROR" and "\n" not in line["message"]
    assert "pip install 'kvfleet[otel]'" in line["message"] and ENDPOINT in line["message"]
    monkeypatch.setenv(OTLP_TRACES_ENV, ENDPOINT)
    with captured_logs(), pytest.raises(SystemExit) as exc:
        router_main(["--endpoints", "127.0.0.1:1"])
    assert "pip install 'kvfleet[otel]'" in str(exc.value.code)


def test_tracing_off_imports_no_opentelemetry():
    code = (
        "import sys\n"
        "import kvfleet.engine.cli, kvfleet.engine.server.app, kvfleet.router.main\n"
        "import kvfleet.operator.main\n"
        "from kvfleet.telemetry.tracing import tracing_from\n"
        "assert tracing_from(None, 'engine') is None\n"
        "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != OTLP_TRACES_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
