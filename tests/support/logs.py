"""The processes' log set-up pointed at a buffer for a test, and undone after it."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvfleet.telemetry.logs import configure_logging


@contextmanager
def captured_logs(log_format: str = "json", level: str = "INFO") -> Iterator[io.StringIO]:
    """configure_logging into a buffer; the root logger's handlers and level (pytest's capture
    included) are put back on exit."""
    root = logging.getLogger()
    handlers, old_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging(level, log_format, stream)
    try:
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(old_level)


def json_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    """Every line of the buffer as a JSON object; a line that is not one fails the test."""
    lines = stream.getvalue().splitlines()
    parsed = []
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not a JSON log line: {line!r}") from e
        assert isinstance(entry, dict), line
        parsed.append(entry)
    return parsed
