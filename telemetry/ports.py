"""The ports the engine and the router listen on by default, which the other processes connect
to: the operator declares them in its manifests and scrapes /metrics there, and the router
reaches the engines behind a Service at the engine's."""

from __future__ import annotations

ENGINE_PORT = 8000
ROUTER_PORT = 8080
