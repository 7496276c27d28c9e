"""Tracing set-up from OTEL_* variables, and trace-context propagation helpers."""

from __future__ import annotations

import pytest
from headrace.sdk import tracing
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter

ENDPOINT = "http://127.0.0.1:4317"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)


def test_nothing_is_exported_without_an_endpoint_or_exporter() -> None:
    assert tracing._exporter_names() == []
    assert tracing.configure_tracing("headrace-test") is None


@pytest.mark.parametrize(
    "name", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_otlp_endpoint_turns_on_the_otlp_exporter(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv(name, ENDPOINT)
    assert tracing._exporter_names() == ["otlp"]
    assert isinstance(tracing._exporter("otlp"), OTLPSpanExporter)


def test_exporters_named_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing._exporter_names() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, otlp")
    assert tracing._exporter_names() == ["console", "otlp"]
    assert isinstance(tracing._exporter("console"), ConsoleSpanExporter)


def test_sdk_disabled_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.configure_tracing("headrace-test") is None


def test_unsupported_settings_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER: 'zipkin'"):
        tracing._exporter("zipkin")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL: 'http/protobuf'"):
        tracing._exporter("otlp")


def test_the_request_trace_context_wins_over_call_metadata() -> None:
    span = TracerProvider().get_tracer("t").start_span("caller")
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    parent = tracing.parent_context(tracing.carrier(span), [("traceparent", other)])
    extracted = trace.get_current_span(parent).get_span_context()
    assert (extracted.trace_id, extracted.span_id) == (
        span.get_span_context().trace_id,
        span.get_span_context().span_id,
    )
    from_metadata = tracing.parent_context({}, [("traceparent", other), ("bin-bin", b"\x00")])
    assert tracing.trace_id(trace.get_current_span(from_metadata)) == (
        "0af7651916cd43dd8448eb211c80319c"
    )
    # Neither: a root context, so the server's span starts a trace of its own.
    assert not trace.get_current_span(tracing.parent_context({}, [])).get_span_context().is_valid
