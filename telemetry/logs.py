"""Log set-up for the three processes: ``--log-format text`` (for people) or ``json`` (one object
a line, for log pipelines such as Loki, Elasticsearch or Cloud Logging), and the request id that
every line logged while serving a request carries."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

REQUEST_ID_HEADER = "X-Request-Id"
# The id of the request being served, per asyncio task: set by the servers' middleware, read by
# the formatter, so no call site passes it on.
REQUEST_ID: ContextVar[str | None] = ContextVar("kvfleet_request_id", default=None)
# A client's id is taken as given only when it is short and plain, so that it cannot forge log
# lines or blow up every line it tags.
_GOOD_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

# What every LogRecord carries; anything else was passed in `extra=` and is kept.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


def request_id_from(header: str | None) -> str:
    """The request id of a request: the client's (or the router's) X-Request-Id when it is a
    plain token of at most 128 characters, else a new one."""
    if header and _GOOD_REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, then request_id
    while a request is served, exception (the traceback) when there is one, object (the
    Kubernetes object a kopf line is about), and any plain `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # kopf's per-object lines name their object; its other extras are its internals.
        if isinstance(ref := getattr(record, "k8s_ref", None), dict):
            entry["object"] = ref
        for key, value in vars(record).items():
            if key in _RECORD_FIELDS or key in entry or key.startswith("k8s_"):
                continue
            if isinstance(value, str | int | float | bool | list | dict | None):
                entry[key] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


def add_log_flags(parser: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """--log-level and --log-format. defaults=False for a subcommand that repeats its parent's
    flags: then a flag given after the subcommand wins and one left out keeps the parent's."""
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO" if defaults else argparse.SUPPRESS,
        help="the least severe level logged (default: INFO)",
    )
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text" if defaults else argparse.SUPPRESS,
        help="text: one readable line per event; json: one JSON object per line (time, level, "
        "logger, message, request_id, exception) for log pipelines (default: text)",
    )


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one configure_logging installs, so that calling it again replaces it."""


def configure_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Route every logger, libraries' included, through one handler on the root logger in the
    chosen format. A handler that already prints to the console (kopf's CLI set-up, a library's
    basicConfig) is replaced, so that no line comes out twice or in another format; others (a
    file, a test's capture) are kept."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    handler = _Handler(stream or sys.stderr)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    for old in list(root.handlers):
        if isinstance(old, _Handler) or (
            type(old) is not logging.FileHandler
            and isinstance(old, logging.StreamHandler)
            and old.stream in consoles
        ):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
