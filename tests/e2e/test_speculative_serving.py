"""Speculative decoding served: workers with ``--num-speculative-tokens`` behind a router.

Nothing changes on the wire but how many tokens a chunk carries: greedy and seeded sampled
streams through the router equal the in-process API's tokens without speculation, also when
a worker is killed
mid-stream and the router resumes its requests on the other (the tokens emitted so far are
the resumed prompt). The surviving worker's /metrics count the proposals it made and kept.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from headrace.sdk.client import AsyncClient
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import ServerProcess, start_router
from headrace.worker.bench.serve_metrics import moved, scrape
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import load_report, start_worker, wait_serving

SPECULATING = ("--num-speculative-tokens", "3", "--speculative-max-seqs", "64")
NUM_STREAMS, MAX_TOKENS = 16, 80


def _worker(model: Path, logs: Path, name: str) -> ServerProcess:
    (logs / name).mkdir()
    return start_worker(model, logs / name, *SPECULATING, "--metrics-port", "0")


def _counter(port: int | None, name: str) -> float:
    assert port is not None
    return moved({}, scrape(f"http://127.0.0.1:{port}/metrics"), name)


def test_a_failover_between_speculating_workers_repeats_and_loses_nothing(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    prompts: list[str | list[int]] = [f"speculate {i} " * (1 + i % 3) for i in range(NUM_STREAMS)]
    configs = [
        GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.3, seed=i, ignore_eos=True)
        for i in range(NUM_STREAMS)
    ]
    want = [r.token_ids for r in offline.generate(prompts, configs)]
    a, b = _worker(tiny_model, tmp_path, "a"), _worker(tiny_model, tmp_path, "b")
    router = start_router([a.target, b.target], log_path=tmp_path / "router.log")
    with a, b, router:
        assert wait_serving(router.target)

        async def run() -> list[list[int]]:
            async with AsyncClient(router.target) as client:
                streamed: dict[int, list[int]] = {i: [] for i in range(NUM_STREAMS)}

                async def one(i: int) -> None:
                    async for chunk in client.stream(prompts[i], configs[i]):
                        streamed[i].extend(chunk.token_ids)

                tasks = [asyncio.create_task(one(i)) for i in range(NUM_STREAMS)]
                while sum(map(len, streamed.values())) < NUM_STREAMS * 10:
                    await asyncio.sleep(0.01)
                assert load_report(b.target).running_requests > 0  # b is mid-generation
                b.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)
                return [streamed[i] for i in range(NUM_STREAMS)]

        got = asyncio.run(run())
        proposed = _counter(a.metrics_port, "headrace_worker_speculative_proposed_tokens_total")
        kept = _counter(a.metrics_port, "headrace_worker_speculative_accepted_tokens_total")
    assert got == want
    assert "resuming request" in (tmp_path / "router.log").read_text()
    assert proposed >= kept > 0
