"""The worker's Prometheus metrics: per-request latencies (`RequestMetrics`) plus the engine's
state, read from its load snapshot at scrape time so the step loop never pays for a gauge."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from headrace.sdk.telemetry import NAMESPACE, TTFT_BUCKETS, RequestMetrics
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.engine.outputs import StepStats
from prometheus_client import CollectorRegistry, Histogram
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
        #: The worker's own part of a request's time to first token after its queue.
        self.prefill_time = Histogram(
            "request_prefill_time_seconds",
            "From a request's first step until its first token.",
            ["model"],
            namespace=NAMESPACE,
            subsystem=SUBSYSTEM,
            registry=self.registry,
            buckets=TTFT_BUCKETS,
        ).labels(model=model)
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
        yield from _step_counters(self._model, load.steps)
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


def _step_counters(model: str, steps: StepStats) -> Iterator[Metric]:
    """The engine's steps, their seconds and their tokens, by kind: ``prompt`` (steps that
    computed prompt tokens) and ``decode`` (decodes alone)."""
    series = (
        ("steps", "Engine steps run.", steps.num_prompt_steps, steps.num_decode_steps),
        (
            "step_seconds",
            "Wall time of engine steps (its rate: the share of time the engine computes).",
            steps.prompt_step_s,
            steps.decode_step_s,
        ),
        (
            "step_tokens",
            "Tokens engine steps computed: prompt tokens, and the rest (decodes).",
            steps.num_prompt_tokens,
            steps.num_decode_tokens,
        ),
    )
    for name, doc, prompt, decode in series:
        family = CounterMetricFamily(
            f"{NAMESPACE}_{SUBSYSTEM}_{name}", doc, labels=["model", "kind"]
        )
        family.add_metric([model, "prompt"], prompt)
        family.add_metric([model, "decode"], decode)
        yield family
