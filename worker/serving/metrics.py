"""The worker's Prometheus metrics: per-request latencies (`RequestMetrics`) plus the engine's
state, read from its load snapshot at scrape time so the step loop never pays for a gauge."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from headrace.sdk.telemetry import NAMESPACE, RequestMetrics
from headrace.worker.engine.async_engine import AsyncEngine
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SUBSYSTEM = "worker"


class Draining(Protocol):
    """The worker's `ServingState`, as far as metrics need it."""

    draining: bool


class WorkerMetrics:
    def __init__(self, engine: AsyncEngine, model: str, state: Draining) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry, SUBSYSTEM, {"model": model})
        self.registry.register(_EngineCollector(engine, model, state))


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model: str, state: Draining) -> None:
        self._engine = engine
        self._model = model
        self._state = state

    def collect(self) -> Iterator[Metric]:
        load = self._engine.load

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{NAMESPACE}_{SUBSYSTEM}_{name}", doc, labels=["model"])
            family.add_metric([self._model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{NAMESPACE}_{SUBSYSTEM}_{name}", doc, labels=["model"])
            family.add_metric([self._model], value)
            return family

        used = load.num_total_blocks - load.num_free_blocks
        yield gauge(
            "requests_running", "Requests with a sequence in the batch.", load.num_running_requests
        )
        yield gauge(
            "requests_waiting",
            "Requests waiting to run (new, or all samples preempted).",
            load.num_waiting_requests,
        )
        yield gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use (0 to 1).",
            used / max(1, load.num_total_blocks),
        )
        yield gauge("kv_cache_blocks", "KV-cache blocks in all.", load.num_total_blocks)
        yield counter(
            "prefix_cache_queried_blocks",
            "Full prompt blocks looked up in the prefix cache.",
            load.num_prefix_queried_blocks,
        )
        yield counter(
            "prefix_cache_hit_blocks",
            "Prompt blocks served from the prefix cache (hit rate: rate of this over queried).",
            load.num_prefix_hit_blocks,
        )
        yield counter("preemptions", "Sequences preempted to free KV blocks.", load.num_preemptions)
        spec = load.speculation
        yield counter(
            "speculative_proposed_tokens",
            "Tokens proposed by speculative decoding (checked in a step).",
            spec.num_proposed,
        )
        yield counter(
            "speculative_accepted_tokens",
            "Proposed tokens the model agreed with (kept; acceptance: rate of this over proposed).",
            spec.num_accepted,
        )
        by_position = CounterMetricFamily(
            f"{NAMESPACE}_{SUBSYSTEM}_speculative_accepted_tokens_by_position",
            "Proposed tokens kept, by their position in the step's proposals (1 = first).",
            labels=["model", "position"],
        )
        proposed_by_position = CounterMetricFamily(
            f"{NAMESPACE}_{SUBSYSTEM}_speculative_proposed_tokens_by_position",
            "Tokens proposed, by their position in the step's proposals (1 = first).",
            labels=["model", "position"],
        )
        for i, (made, kept) in enumerate(zip(spec.proposed_at, spec.accepted_at, strict=True)):
            proposed_by_position.add_metric([self._model, str(i + 1)], made)
            by_position.add_metric([self._model, str(i + 1)], kept)
        yield proposed_by_position
        yield by_position
        yield gauge(
            "draining", "1 while the worker drains (takes no new requests).", self._state.draining
        )
