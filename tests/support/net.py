"""Loopback ports and plain HTTP calls for tests that talk to live servers."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_call(
    url: str,
    body: bytes | dict | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    api_key: str | None = None,
) -> tuple[int, dict, bytes]:
    """(status, headers, raw body) of one request, errors included: a dict body is sent as
    JSON, with the bearer key when given; ``headers`` override the defaults."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json"}
    if api_key is not None:
        hdrs["Authorization"] = f"Bearer {api_key}"
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()
