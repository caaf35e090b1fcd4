"""OpenTelemetry traces, optional: the SDK is imported only when an OTLP endpoint is given
(``--otlp-traces-endpoint`` or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), so a process without one
pays nothing and needs no extra package. Context crosses processes as a W3C ``traceparent``
header (router -> engine)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

OTLP_TRACES_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
INSTALL_HINT = "pip install 'kvfleet[otel]'"
_PROPAGATED = ("traceparent", "tracestate")


class TracingUnavailable(RuntimeError):
    """Traces were asked for, but the OpenTelemetry SDK is not installed."""


def add_tracing_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send OpenTelemetry traces over OTLP/HTTP to this URL, e.g. "
        f"http://otel-collector:4318/v1/traces (env {OTLP_TRACES_ENV}; needs {INSTALL_HINT}); "
        "default: no tracing",
    )


def tracing_from(endpoint: str | None, service_name: str) -> Tracing | None:
    """Tracing to the endpoint given, else to the one in the environment; None without either."""
    endpoint = endpoint or os.environ.get(OTLP_TRACES_ENV) or None
    if endpoint is None:
        return None
    url = urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(
            f"the OTLP traces endpoint must be an http(s) URL such as "
            f"http://otel-collector:4318/v1/traces, not {endpoint!r}"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(
            f"an OTLP traces endpoint is set ({endpoint}) but OpenTelemetry is not installed "
            f"({e.name} is missing): {INSTALL_HINT}, or unset it"
        ) from None
    return Tracing.to(OTLPSpanExporter(endpoint=endpoint), service_name)


class Tracing:
    """A tracer provider of this process's own (the global one is left alone) and the W3C
    trace-context propagator."""

    def __init__(self, provider: Any, service_name: str) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer(f"kvfleet.{service_name}")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def to(cls, exporter: Any, service_name: str, *, batch: bool = True) -> Tracing:
        """Spans of service.name kvfleet-<service_name> sent to an SDK span exporter; batched
        off the event loop, or (batch=False, for tests) each as it ends."""
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        resource = Resource.create({"service.name": f"kvfleet-{service_name}"})
        provider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider, service_name)

    @contextmanager
    def server_span(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]
    ) -> Iterator[Any]:
        """A SERVER span, current while the block runs, continuing the caller's trace when its
        headers carry a traceparent; an exception escaping the block is recorded on it."""
        from opentelemetry.trace import SpanKind

        carrier = {key: headers[key] for key in _PROPAGATED if key in headers}
        parent = self.propagator.extract(carrier)
        with self.tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes)
        ) as span:
            yield span

    def inject(self, headers: MutableMapping[str, str]) -> None:
        """The current span's context into outgoing headers, replacing any the caller sent."""
        for key in _PROPAGATED:
            headers.pop(key, None)
        self.propagator.inject(headers)

    def shutdown(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()
