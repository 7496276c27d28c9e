"""Server-side telemetry shared by router and worker: Prometheus metrics on an HTTP port, the
per-request latency series, and one structured log line per finished request.

Each server keeps its metrics in a registry of its own (never the process-global one), so two
servers in one process do not collide. Names follow Prometheus conventions:
``headrace_<router|worker>_<what>_<unit>``, ``_total`` on counters, base units (seconds).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from headrace.sdk import status, tracing
from headrace.sdk.errors import HeadraceError
from headrace.sdk.outputs import Usage
from opentelemetry import trace
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAMESPACE = "headrace"

# Buckets (seconds) spanning a small model on a CPU to a large one behind a long queue.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class MetricsServer:
    """``GET /metrics`` in the Prometheus text format, on a thread of its own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        # A `_created` sample per series doubles the output for nothing Prometheus uses.
        disable_created_metrics()
        self._httpd, self._thread = start_http_server(port, host, registry)

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class RuntimeCollector(Collector):
    """The server process's own vitals, to spot leaks: tasks on its event loop and live
    threads (``headrace_<subsystem>_event_loop_tasks``, ``..._threads``)."""

    def __init__(self, subsystem: str, loop: asyncio.AbstractEventLoop) -> None:
        self._prefix = f"{NAMESPACE}_{subsystem}"
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        # Read from the scrape thread: all_tasks copies its set (and retries if it changes).
        tasks = len(asyncio.all_tasks(self._loop))
        yield GaugeMetricFamily(
            f"{self._prefix}_event_loop_tasks", "Tasks on the server's event loop.", value=tasks
        )
        yield GaugeMetricFamily(
            f"{self._prefix}_threads",
            "Live threads of the process.",
            value=threading.active_count(),
        )


class RequestMetrics:
    """The per-request series of one server (``subsystem`` is "router" or "worker"), each
    with the server's constant ``labels`` (the worker's model)."""

    def __init__(self, registry: CollectorRegistry, subsystem: str, labels: dict[str, str]) -> None:
        names = list(labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(
                name,
                doc,
                names,
                namespace=NAMESPACE,
                subsystem=subsystem,
                registry=registry,
                buckets=buckets,
            )
            return family.labels(**labels) if labels else family

        def counter(name: str, doc: str) -> Counter:
            family = Counter(
                name, doc, names, namespace=NAMESPACE, subsystem=subsystem, registry=registry
            )
            return family.labels(**labels) if labels else family

        self._labels = labels
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "From arrival to the first streamed token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Between successive streamed steps of one request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "From arrival to the last chunk.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "From arrival until the request first runs (router: is dispatched to a worker).",
            QUEUE_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens streamed to clients.")
        self._finished = Counter(
            "requests_finished",
            "Requests that ended, by finish reason (stop, length, cancelled, error).",
            [*names, "finish_reason"],
            namespace=NAMESPACE,
            subsystem=subsystem,
            registry=registry,
        )

    def finished(self, finish_reason: str) -> None:
        self._finished.labels(**self._labels, finish_reason=finish_reason).inc()


@dataclass(slots=True)
class RequestClock:
    """One request's streaming times (`time.monotonic()` seconds), feeding `RequestMetrics`."""

    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None

    def tokens(self, now_s: float, num_tokens: int, metrics: RequestMetrics) -> None:
        """``num_tokens`` more were streamed at ``now_s`` (one call per response and request;
        further calls with the same ``now_s`` only count tokens, as n samples do)."""
        if num_tokens == 0:
            return
        metrics.generation_tokens.inc(num_tokens)
        if self.last_token_s is None:
            self.first_token_s = now_s
            metrics.time_to_first_token.observe(now_s - self.arrival_s)
        elif now_s != self.last_token_s:
            metrics.inter_token_latency.observe(now_s - self.last_token_s)
        self.last_token_s = now_s

    def finish(self, finish_reason: str, num_prompt_tokens: int, metrics: RequestMetrics) -> float:
        """Record the end of the request; returns its end-to-end latency."""
        e2e_s = time.monotonic() - self.arrival_s
        metrics.e2e_request_latency.observe(e2e_s)
        metrics.prompt_tokens.inc(num_prompt_tokens)
        metrics.finished(finish_reason)
        return e2e_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass(slots=True)
class RequestTelemetry:
    """One request at one server: its span, its clock, and its log line when it ends."""

    request_id: str
    span: trace.Span
    clock: RequestClock

    @classmethod
    def start(cls, name: str, request_id: str, parent: tracing.Context) -> RequestTelemetry:
        span = tracing.tracer().start_span(
            name,
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={tracing.REQUEST_ID: request_id},
        )
        return cls(request_id, span, RequestClock(time.monotonic()))

    def queued(self, start_s: float, end_s: float, metrics: RequestMetrics) -> float:
        """The request waited from start_s to end_s (monotonic): observe it, and record a
        `queue` child span; returns the wait."""
        metrics.queue_time.observe(end_s - start_s)
        if self.span.is_recording():
            tracing.child_span(self.span, "queue", start_s, end_s)
        return end_s - start_s

    def finish(
        self,
        finish_reason: str,
        usage: Usage | None,
        error: HeadraceError | None,
        metrics: RequestMetrics,
        logger: logging.Logger,
        **fields: object,
    ) -> None:
        """Observe the end-to-end latency, end the span, and log the request's line."""
        usage = usage or Usage()
        e2e_s = self.clock.finish(finish_reason, usage.num_prompt_tokens, metrics)
        span = self.span
        if span.is_recording():
            span.set_attributes(
                {
                    "headrace.finish_reason": finish_reason,
                    "headrace.prompt_tokens": usage.num_prompt_tokens,
                    "headrace.generated_tokens": usage.num_generated_tokens,
                    "headrace.cached_tokens": usage.num_cached_tokens,
                }
            )
            if error is not None:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
        span.end()
        log_request(
            logger,
            request_id=self.request_id,
            finish_reason=finish_reason,
            prompt_tokens=usage.num_prompt_tokens,
            generated_tokens=usage.num_generated_tokens,
            cached_tokens=usage.num_cached_tokens,
            ttft_s=self.clock.ttft_s,
            e2e_s=e2e_s,
            **fields,
            error=None if error is None else status.status_code(error).name,
            trace_id=tracing.trace_id(span) or None,
        )


def log_request(logger: logging.Logger, **fields: object) -> None:
    """One line per finished request, as ``request finished key=value ...`` (logfmt).

    Floats are seconds rounded to the microsecond; None values are left out.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    parts = ["request finished"]
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = f"{value:.6f}"
        text = str(value)
        if not text or any(c in text for c in ' "=\\'):
            text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        parts.append(f"{key}={text}")
    logger.info(" ".join(parts))
