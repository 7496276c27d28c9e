"""The router's Prometheus metrics: per-request latencies as clients see them
(`RequestMetrics`), failovers and refusals, and the queue and each worker's state, read at
scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from headrace.sdk.telemetry import NAMESPACE, RequestMetrics
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from headrace.router.router import Router
    from headrace.router.workers import WorkerLink

SUBSYSTEM = "router"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry, SUBSYSTEM, {})
        self.failovers = Counter(
            "failovers",
            "Requests resumed on another worker after theirs failed.",
            namespace=NAMESPACE,
            subsystem=SUBSYSTEM,
            registry=self.registry,
        )
        self._rejected = Counter(
            "requests_rejected",
            "Requests refused at admission, by gRPC status code.",
            ["code"],
            namespace=NAMESPACE,
            subsystem=SUBSYSTEM,
            registry=self.registry,
        )

    def rejected(self, code: str) -> None:
        self._rejected.labels(code=code).inc()

    def watch(self, router: Router) -> None:
        """Report the router's queue and workers at each scrape."""
        self.registry.register(_RouterCollector(router))


class _RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        yield _gauge("requests_queued", "Requests waiting for a worker.", len(router.queue))
        yield _gauge(
            "requests_active", "Requests admitted and not finished.", router.active.num_in_flight
        )
        links = list(router.pool.links.values())
        yield _per_worker(
            "worker_up",
            "1 if the worker is in rotation (healthy, not draining).",
            links,
            lambda link: float(link.accepting),
        )
        yield _per_worker(
            "worker_requests_in_flight",
            "Requests the router has on the worker.",
            links,
            lambda link: float(link.num_inflight),
        )
        yield _per_worker(
            "worker_free_kv_blocks",
            "Free KV-cache blocks by the worker's last report.",
            links,
            lambda link: float(link.free_kv_blocks),
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{SUBSYSTEM}_{name}", doc, value=value)


def _per_worker(
    name: str, doc: str, links: list[WorkerLink], value: Callable[[WorkerLink], float]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{NAMESPACE}_{SUBSYSTEM}_{name}", doc, labels=["worker"])
    for link in links:
        family.add_metric([link.target], value(link))
    return family
