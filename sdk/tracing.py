"""OpenTelemetry tracing: set up from the standard `OTEL_*` variables, and W3C trace context
carried from client to router to worker.

A request's spans on the SDK, the router and the worker form one trace. Each hop starts its
span as a child of the caller's context and hands its own context on with the request: in
`Request.trace_context` (a multiplexed `Generate` stream carries many requests, so call
metadata, which belongs to the whole stream, cannot), or in call metadata (`traceparent`),
which a plain gRPC client with OpenTelemetry instrumentation sends on `GenerateOne`.

Only the OpenTelemetry API is needed here, so the SDK client stays light: its spans are
no-ops until the application installs a tracer provider. headrace's own servers and the
command line install one with `configure_tracing`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)

Context = otel_context.Context

#: The attribute naming the request (the id the caller of that hop chose).
REQUEST_ID = "headrace.request_id"

_OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracer() -> trace.Tracer:
    return trace.get_tracer("headrace")


def parent_context(
    trace_context: Mapping[str, str], metadata: Iterable[tuple[str, Any]] | None = None
) -> Context:
    """The caller's context: from the request's own trace context, else the call's metadata.

    With neither, an empty context, so the span starts a trace of its own (the server's
    ambient context is never a request's parent).
    """
    if trace_context:
        return propagate.extract(dict(trace_context))
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return propagate.extract(carrier) if carrier else Context()


def carrier(span: trace.Span) -> dict[str, str]:
    """The W3C trace context that makes the next hop's span a child of ``span``."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(span))
    return headers


def trace_id(span: trace.Span) -> str:
    """The span's trace id as 32 hex digits; empty if the span has no valid context."""
    span_context = span.get_span_context()
    return trace.format_trace_id(span_context.trace_id) if span_context.is_valid else ""


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as nanoseconds since the epoch (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def child_span(parent: trace.Span, name: str, start_s: float, end_s: float) -> None:
    """Record a finished child span of ``parent`` between two `time.monotonic()` readings."""
    span = tracer().start_span(
        name, context=trace.set_span_in_context(parent), start_time=epoch_ns(start_s)
    )
    span.end(end_time=epoch_ns(end_s))


def configure_tracing(default_service_name: str) -> Any | None:
    """Install a tracer provider as the standard `OTEL_*` variables ask; None if none.

    Exporters come from `OTEL_TRACES_EXPORTER` (``otlp``, ``console``, ``none``; a comma
    list). Unset, it is ``otlp`` when an OTLP endpoint variable is set and nothing otherwise,
    so a server without telemetry configured pays for no spans. The OTLP exporter, sampler,
    batch processor and resource read their own `OTEL_*` variables. `OTEL_SERVICE_NAME`
    overrides ``default_service_name``. Returns the provider, whose ``shutdown()`` flushes
    spans at exit. Raises ValueError for a setting it cannot honour.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = _exporter_names()
    if not names:
        return None
    # Imported here: the OpenTelemetry SDK comes with the router and worker extras only.
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise ValueError(
            f"exporting spans ({', '.join(names)}) needs the OpenTelemetry SDK: install "
            "headrace[router] or opentelemetry-sdk and opentelemetry-exporter-otlp-proto-grpc"
        ) from error

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    logger.info("tracing: exporting spans with %s", ", ".join(names))
    return provider


def _exporter_names() -> list[str]:
    value = os.environ.get("OTEL_TRACES_EXPORTER")
    if value is None:
        return ["otlp"] if any(os.environ.get(name) for name in _OTLP_ENDPOINTS) else []
    names = [name.strip().lower() for name in value.split(",") if name.strip()]
    return [name for name in names if name != "none"]


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER: {name!r} is not one of otlp, console, none")
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol != "grpc":
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported; headrace ships the "
            "OTLP exporter over gRPC (set it to 'grpc')"
        )
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()
