"""Loopback ports and plain HTTP calls for tests that talk to live servers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
