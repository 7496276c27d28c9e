"""Observability end to end: one trace across SDK, router and worker; /metrics of both
servers moving with the requests they serve; one log line per finished request.

The servers export spans over OTLP/gRPC (set up by the standard OTEL_* variables) to a
collector this test runs; the SDK, in this process, records its spans in memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import start_router
from headrace.worker.bench.serve_metrics import Snapshot, scrape
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.e2e.processes import ServerProcess, start_worker, wait_all_blocks_free, wait_serving

pytestmark = pytest.mark.timeout(300)

GREEDY = GenerationConfig(max_tokens=6, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class ExportedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    events: tuple[str, ...]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(_exported(span, resource.get("service.name", "")))
        return trace_service_pb2.ExportTraceServiceResponse()

    def in_trace(self, trace_id: str) -> list[ExportedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]


def _exported(span: object, service: str) -> ExportedSpan:
    attributes: dict[str, object] = {}
    for attribute in span.attributes:  # type: ignore[attr-defined]
        value = attribute.value
        attributes[attribute.key] = getattr(value, value.WhichOneof("value"))
    return ExportedSpan(
        name=span.name,  # type: ignore[attr-defined]
        service=service,
        trace_id=span.trace_id.hex(),  # type: ignore[attr-defined]
        span_id=span.span_id.hex(),  # type: ignore[attr-defined]
        parent_span_id=span.parent_span_id.hex(),  # type: ignore[attr-defined]
        attributes=attributes,
        events=tuple(event.name for event in span.events),  # type: ignore[attr-defined]
    )


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def sdk_spans() -> InMemorySpanExporter:
    """The test process is the SDK's application: it installs a provider, as users do."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    collector: tuple[Collector, int],
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A worker and a router, each with /metrics and exporting spans to the collector."""
    logs = tmp_path_factory.mktemp("telemetry")
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector[1]}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        worker = start_worker(tiny_model, logs, "--metrics-port", "0")
        with worker:
            router = start_router(
                [worker.target], "--metrics-port", "0", "--http-port", "0",
                log_path=logs / "router.log",
            )  # fmt: skip
            with router:
                assert wait_serving(router.target)
                yield worker, router


def _wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_one_trace_spans_sdk_router_and_worker(
    stack: tuple[ServerProcess, ServerProcess],
    collector: tuple[Collector, int],
    sdk_spans: InMemorySpanExporter,
) -> None:
    worker, router = stack
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("application") as root, Client(router.target) as client:
        result = client.generate([5, 6, 7, 8, 9], GREEDY)
    assert len(result.token_ids) == GREEDY.max_tokens
    trace_id = trace.format_trace_id(root.get_span_context().trace_id)
    root_span_id = trace.format_span_id(root.get_span_context().span_id)

    sdk = [s for s in sdk_spans.get_finished_spans() if s.name == "headrace.generate"]
    assert len(sdk) == 1
    sdk_span = sdk[0]
    assert trace.format_trace_id(sdk_span.context.trace_id) == trace_id
    assert sdk_span.parent is not None
    assert trace.format_span_id(sdk_span.parent.span_id) == root_span_id
    sdk_span_id = trace.format_span_id(sdk_span.context.span_id)

    spans = collector[0]
    names = {"router.generate", "worker.generate", "queue", "prefill", "decode"}
    _wait_for(lambda: names <= {s.name for s in spans.in_trace(trace_id)})
    by_name: dict[str, list[ExportedSpan]] = {}
    for span in spans.in_trace(trace_id):
        by_name.setdefault(span.name, []).append(span)
    (router_span,) = by_name["router.generate"]
    (worker_span,) = by_name["worker.generate"]
    assert router_span.service == "headrace-router"
    assert worker_span.service == "headrace-worker"
    # SDK → router → worker, each the parent of the next.
    assert router_span.parent_span_id == sdk_span_id
    assert worker_span.parent_span_id == router_span.span_id
    assert (
        router_span.attributes["headrace.request_id"] == sdk_span.attributes["headrace.request_id"]
    )
    assert "dispatched" in router_span.events
    assert router_span.attributes["headrace.generated_tokens"] == GREEDY.max_tokens
    assert worker_span.attributes["headrace.finish_reason"] == "length"
    # Queue time on both; prefill and decode under the worker's span.
    parents = {span.name: span.parent_span_id for spans_ in by_name.values() for span in spans_}
    assert {s.parent_span_id for s in by_name["queue"]} == {
        router_span.span_id,
        worker_span.span_id,
    }
    assert parents["prefill"] == parents["decode"] == worker_span.span_id

    # The request's log lines carry the same trace id.
    for server in (worker, router):
        assert server.log_path is not None
        _wait_for(lambda s=server: f"trace_id={trace_id}" in s.log_path.read_text())
        line = next(line for line in server.log_path.read_text().splitlines() if trace_id in line)
        assert "request finished" in line
        assert f"generated_tokens={GREEDY.max_tokens}" in line
        assert "prompt_tokens=5" in line
        assert "finish_reason=length" in line


def test_generate_one_joins_the_trace_in_call_metadata(
    stack: tuple[ServerProcess, ServerProcess], collector: tuple[Collector, int]
) -> None:
    """A plain gRPC client (no headrace SDK) sends `traceparent` as call metadata."""
    _, router = stack
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    request = pb.Request(request_id="plain", token_ids=pb.TokenIds(ids=[3, 4, 5]))
    request.config.max_tokens = 2
    with grpc.insecure_channel(router.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        metadata = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)
        responses = list(stub.GenerateOne(request, metadata=metadata, timeout=30))
    assert responses[-1].chunks[-1].finished
    spans = collector[0]
    _wait_for(lambda: {"router.generate", "worker.generate"} <= _names(spans, trace_id))
    (router_span,) = [s for s in spans.in_trace(trace_id) if s.name == "router.generate"]
    assert router_span.parent_span_id == parent_id


def test_an_http_call_is_one_span_joining_the_callers_trace(
    stack: tuple[ServerProcess, ServerProcess], collector: tuple[Collector, int]
) -> None:
    """The OpenAI door: its span is the child of the caller's `traceparent` header and the
    parent of the router's span of the request; /metrics counts the call by route and status."""
    _, router = stack
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    before = _scrape(router.metrics_port)
    reply = httpx.post(
        f"http://127.0.0.1:{router.http_port}/v1/completions",
        json={"prompt": [3, 4, 5], "max_tokens": 2},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert reply.status_code == 200
    spans = collector[0]
    names = {"POST /v1/completions", "router.generate", "worker.generate"}
    _wait_for(lambda: names <= _names(spans, trace_id))
    by_name = {span.name: span for span in spans.in_trace(trace_id)}
    http_span = by_name["POST /v1/completions"]
    assert http_span.service == "headrace-router" and http_span.parent_span_id == parent_id
    assert http_span.attributes["http.response.status_code"] == 200
    assert by_name["router.generate"].parent_span_id == http_span.span_id
    assert by_name["worker.generate"].parent_span_id == by_name["router.generate"].span_id
    after = _scrape(router.metrics_port)
    labels = {"route": "/v1/completions", "status": "200"}
    counter = "headrace_router_http_requests_total"
    assert _value(after, counter, **labels) - _value(before, counter, **labels) == 1


def _names(collector: Collector, trace_id: str) -> set[str]:
    return {span.name for span in collector.in_trace(trace_id)}


def _scrape(port: int | None) -> Snapshot:
    assert port is not None
    return scrape(f"http://127.0.0.1:{port}/metrics")


def _value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_requests_on_worker_and_router(
    stack: tuple[ServerProcess, ServerProcess], tiny_model: Path
) -> None:
    worker, router = stack
    model = {"model": str(tiny_model)}
    worker_before, router_before = _scrape(worker.metrics_port), _scrape(router.metrics_port)
    # Two prompts sharing 32 tokens (two 16-token blocks): the second hits the prefix cache.
    shared = list(range(10, 42))
    prompts = [shared + [50, 51, 52], shared + [60, 61], [7, 8, 9]]
    with Client(router.target) as client:
        for prompt in prompts:
            client.generate(prompt, GREEDY)
    wait_all_blocks_free(worker.target)
    worker_after, router_after = _scrape(worker.metrics_port), _scrape(router.metrics_port)

    def moved(before: dict, after: dict, name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    num_requests, num_tokens = len(prompts), len(prompts) * GREEDY.max_tokens
    num_prompt_tokens = sum(len(p) for p in prompts)
    for prefix, before, after, labels in (
        ("headrace_worker", worker_before, worker_after, model),
        ("headrace_router", router_before, router_after, {}),
    ):
        assert moved(before, after, f"{prefix}_generation_tokens_total", **labels) == num_tokens
        assert moved(before, after, f"{prefix}_prompt_tokens_total", **labels) == num_prompt_tokens
        assert (
            moved(
                before, after, f"{prefix}_requests_finished_total", **labels, finish_reason="length"
            )
            == num_requests
        )
        for histogram in (
            "time_to_first_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
        ):
            assert moved(before, after, f"{prefix}_{histogram}_count", **labels) == num_requests
        # One inter-token gap per token after the first.
        assert moved(before, after, f"{prefix}_inter_token_latency_seconds_count", **labels) == (
            num_tokens - num_requests
        )

    def worker_moved(name: str, **labels: str) -> float:
        return moved(worker_before, worker_after, f"headrace_worker_{name}", **model, **labels)

    assert worker_moved("request_prefill_time_seconds_count") == num_requests
    # One request at a time: a prompt step each, then a decode step per later token. The
    # second prompt's two shared blocks (32 tokens) come from the prefix cache.
    steps = {
        ("steps_total", "prompt"): num_requests,
        ("steps_total", "decode"): num_tokens - num_requests,
        ("step_tokens_total", "prompt"): num_prompt_tokens - 32,
        ("step_tokens_total", "decode"): num_tokens - num_requests,
    }
    for (name, kind), count in steps.items():
        assert worker_moved(name, kind=kind) == count
    for kind in ("prompt", "decode"):
        assert worker_moved("step_seconds_total", kind=kind) > 0
    # Blocks looked up: 2 + 2 + 0 full blocks (one token always left to compute); found: 2.
    prefix = "headrace_worker_prefix_cache"
    assert moved(worker_before, worker_after, f"{prefix}_queried_blocks_total", **model) == 4
    assert moved(worker_before, worker_after, f"{prefix}_hit_blocks_total", **model) == 2
    assert _value(worker_after, "headrace_worker_requests_running", **model) == 0
    assert _value(worker_after, "headrace_worker_kv_cache_usage_ratio", **model) == 0
    assert _value(worker_after, "headrace_worker_kv_cache_blocks", **model) > 0
    assert _value(router_after, "headrace_router_worker_up", worker=worker.target) == 1
    assert _value(router_after, "headrace_router_requests_queued") == 0
    assert _value(router_after, "headrace_router_failovers_total") == 0
