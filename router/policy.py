"""Routing policies: which of the workers that can take a request gets it.

Every policy sees only workers that are healthy, not draining, and have room (the caller
filters), so a policy never has to say "none".
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from headrace.router.config import RouterConfig

if TYPE_CHECKING:
    from headrace.router.request import RoutedRequest
    from headrace.router.workers import WorkerLink


class Policy(Protocol):
    def choose(self, request: RoutedRequest, workers: Sequence[WorkerLink]) -> WorkerLink: ...


def load_key(worker: WorkerLink) -> tuple[int, int, int]:
    """Least loaded first: fewest queued tokens, then most free KV blocks, then fewest
    requests in flight (each counting what the router sent since the last load report)."""
    return (worker.queued_tokens, -worker.free_kv_blocks, worker.num_inflight)


class LeastLoaded:
    def choose(self, request: RoutedRequest, workers: Sequence[WorkerLink]) -> WorkerLink:
        return min(workers, key=load_key)


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RoutedRequest, workers: Sequence[WorkerLink]) -> WorkerLink:
        ordered = sorted(workers, key=lambda w: w.target)
        return ordered[next(self._turn) % len(ordered)]


class PrefixAffinity:
    """Requests whose prompts start alike go to the same worker, so its prefix cache hits.

    The prefix (the first characters of text, or the first token ids) picks a worker by
    rendezvous hashing, which moves only that worker's share when workers come and go. If
    the chosen worker is much busier than the least-loaded one, load wins.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.slack = config.affinity_slack
        self._least_loaded = LeastLoaded()

    def choose(self, request: RoutedRequest, workers: Sequence[WorkerLink]) -> WorkerLink:
        preferred = max(workers, key=lambda w: _score(request.affinity_key, w.target))
        least = self._least_loaded.choose(request, workers)
        if preferred.num_inflight > least.num_inflight + self.slack:
            return least
        return preferred


def _score(key: bytes, target: str) -> bytes:
    return hashlib.blake2b(key + target.encode(), digest_size=8).digest()


def make_policy(config: RouterConfig) -> Policy:
    if config.policy == "round-robin":
        return RoundRobin()
    if config.policy == "prefix-affinity":
        return PrefixAffinity(config)
    return LeastLoaded()
