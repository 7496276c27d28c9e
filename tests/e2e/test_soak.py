"""Soak: thousands of requests through a router, a fifth of them cancelled at random points.
Every request completes or is cancelled, every KV block comes back, and the servers' tasks,
threads and memory do not grow with the number of requests served.

``HEADRACE_SOAK_REQUESTS`` sets the count (default 5000); the figures are printed.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from headrace.sdk.client import AsyncClient
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import ServerProcess, start_router

from tests.e2e.processes import start_worker, wait_all_blocks_free, wait_serving

NUM_REQUESTS = int(os.environ.get("HEADRACE_SOAK_REQUESTS", "5000"))
CONCURRENCY = 64
CANCEL_SHARE = 0.2
#: Resident memory either server may gain over the soak (a leak of 1 KiB per request would
#: already be 5 MB at the default count; this bound catches only gross leaks).
MAX_RSS_GROWTH_MB = 150


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("soak")
    metrics = ("--metrics-port", "0", "--log-level", "warning")
    with (
        start_worker(tiny_model, logs, *metrics) as worker,
        start_router([worker.target], *metrics, log_path=logs / "router.log") as router,
    ):
        assert wait_serving(router.target)
        yield worker, router


def vitals(server: ServerProcess, subsystem: str) -> dict[str, float]:
    """The server's event-loop tasks and threads (its own metrics), and resident memory."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = dict(
        re.findall(rf"^headrace_{subsystem}_(event_loop_tasks|threads) (\S+)$", text, re.M)
    )
    rss_mb = psutil.Process(server.proc.pid).memory_info().rss / 2**20
    return {
        "tasks": float(found["event_loop_tasks"]),
        "threads": float(found["threads"]),
        "rss_mb": rss_mb,
    }


async def _soak(target: str, num_requests: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcomes = {"completed": 0, "cancelled": 0}
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(client: AsyncClient, i: int) -> None:
        config = GenerationConfig(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True)
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 24))]
        cancel_after = rng.randint(0, config.max_tokens) if rng.random() < CANCEL_SHARE else None
        async with limit:
            num_tokens = 0
            async for chunk in client.stream(prompt, config):
                num_tokens += len(chunk.token_ids)
                if cancel_after is not None and num_tokens >= cancel_after:
                    outcomes["cancelled"] += 1  # leaving the loop cancels the request
                    return
                if chunk.finished:
                    assert num_tokens == config.max_tokens
                    outcomes["completed"] += 1

    async with AsyncClient(target) as client:
        await asyncio.gather(*(one(client, i) for i in range(num_requests)))
    return outcomes


def test_soak_with_random_cancels_leaks_nothing(servers) -> None:
    worker, router = servers
    asyncio.run(_soak(router.target, 300, seed=1))  # warm-up: allocators, caches, threads
    wait_all_blocks_free(worker.target)
    before = {"worker": vitals(worker, "worker"), "router": vitals(router, "router")}
    outcomes = asyncio.run(_soak(router.target, NUM_REQUESTS, seed=2))
    report = wait_all_blocks_free(worker.target)
    after = {"worker": vitals(worker, "worker"), "router": vitals(router, "router")}
    print(f"\nsoak: {NUM_REQUESTS} requests, {outcomes}; before {before}; after {after}")
    assert outcomes["completed"] + outcomes["cancelled"] == NUM_REQUESTS
    assert outcomes["cancelled"] >= NUM_REQUESTS * CANCEL_SHARE / 2
    assert report.free_kv_blocks == report.total_kv_blocks
    assert report.running_requests == report.waiting_requests == 0
    for name in ("worker", "router"):
        assert after[name]["tasks"] <= before[name]["tasks"] + 2, (name, before, after)
        assert after[name]["threads"] <= before[name]["threads"], (name, before, after)
        assert after[name]["rss_mb"] - before[name]["rss_mb"] < MAX_RSS_GROWTH_MB, name
