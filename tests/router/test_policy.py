"""Routing policies over stand-in worker links."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headrace.router.config import RouterConfig
from headrace.router.policy import LeastLoaded, PrefixAffinity, RoundRobin


@dataclass
class FakeLink:
    target: str
    queued_tokens: int = 0
    free_kv_blocks: int = 100
    num_inflight: int = 0


@dataclass
class FakeRequest:
    affinity_key: bytes


def choose(policy: Any, key: bytes, links: list[FakeLink]) -> str:
    return policy.choose(FakeRequest(key), links).target


def test_least_loaded_prefers_fewer_queued_tokens_then_more_free_blocks() -> None:
    links = [FakeLink("a", queued_tokens=50), FakeLink("b", queued_tokens=10, free_kv_blocks=5)]
    assert choose(LeastLoaded(), b"", links) == "b"
    links = [FakeLink("a", free_kv_blocks=5), FakeLink("b", free_kv_blocks=50)]
    assert choose(LeastLoaded(), b"", links) == "b"


def test_round_robin_cycles() -> None:
    links = [FakeLink("b"), FakeLink("a"), FakeLink("c")]
    policy = RoundRobin()
    assert [choose(policy, b"", links) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_prefix_affinity_is_sticky_until_the_worker_is_much_busier() -> None:
    policy = PrefixAffinity(RouterConfig(workers=("a:1",), affinity_slack=4))
    links = [FakeLink("a"), FakeLink("b"), FakeLink("c")]
    keys = [f"system prompt {i}".encode() for i in range(20)]
    chosen = {key: choose(policy, key, links) for key in keys}
    assert len(set(chosen.values())) > 1  # different prefixes spread out
    assert all(choose(policy, key, links) == chosen[key] for key in keys)  # same prefix, same
    key = keys[0]
    busy = next(link for link in links if link.target == chosen[key])
    busy.num_inflight = 4
    assert choose(policy, key, links) == chosen[key]  # within the slack: still sticky
    busy.num_inflight = 5
    assert choose(policy, key, links) != chosen[key]  # much busier: load wins
