"""A real router in front of real workers: spreading, prefix affinity, priority, failover on
kill -9, cancel and admission limits."""

from __future__ import annotations

import asyncio
import queue
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import launch, status, wire
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import DeadlineExceededError, ResourceExhaustedError, UnavailableError
from headrace.sdk.launch import ServerProcess, start_router
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import (
    load_report,
    pause,
    start_worker,
    stopped,
    wait_all_blocks_free,
    wait_serving,
)

GREEDY = GenerationConfig(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def two_workers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("router-workers")
    with _worker(tiny_model, logs, "a") as a, _worker(tiny_model, logs, "b") as b:
        yield [a, b]


def _worker(model: Path, logs: Path, name: str, *args: str) -> ServerProcess:
    folder = logs / name
    folder.mkdir(exist_ok=True)
    return start_worker(model, folder, *args)


def _router(workers: list[ServerProcess], log_dir: Path, *args: str) -> ServerProcess:
    router = start_router([w.target for w in workers], *args, log_path=log_dir / "router.log")
    assert wait_serving(router.target)
    return router


def _admitted(workers: list[ServerProcess]) -> list[int]:
    return [load_report(w.target).admitted_requests for w in workers]


async def _generate_all(
    target: str, prompts: list[str | list[int]], configs: list[GenerationConfig]
) -> list[list[int]]:
    async with AsyncClient(target) as client:
        results = await asyncio.gather(
            *(client.generate(p, c) for p, c in zip(prompts, configs, strict=True))
        )
    return [r.token_ids for r in results]


def test_router_output_equals_worker_and_spreads_over_both(
    two_workers: list[ServerProcess], offline: LLM, tmp_path: Path
) -> None:
    prompts: list[str | list[int]] = [f"request number {i} about boats" for i in range(40)]
    before = _admitted(two_workers)
    with _router(two_workers, tmp_path) as router:
        got = asyncio.run(_generate_all(router.target, prompts, [GREEDY] * len(prompts)))
    after = _admitted(two_workers)
    want = [r.token_ids for r in offline.generate(prompts, GREEDY)]  # type: ignore[arg-type]
    assert got == want
    spread = [b - a for a, b in zip(before, after, strict=True)]
    assert sum(spread) == 40
    assert min(spread) >= 10, spread  # least-loaded keeps both busy


def test_prefix_affinity_sends_a_shared_prefix_to_one_worker(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    shared = [100 + (i * 7) % 300 for i in range(96)]  # 6 full KV blocks
    prompts: list[str | list[int]] = [[*shared, 5 + i, 6 + i] for i in range(12)]
    configs = [GenerationConfig(max_tokens=4, temperature=0.0)] * len(prompts)
    before = _admitted(two_workers)
    hits_before = [load_report(w.target).prefix_cache_hit_blocks for w in two_workers]
    with _router(two_workers, tmp_path, "--policy", "prefix-affinity") as router:
        for prompt in prompts:  # one after another: each can reuse the previous one's blocks
            asyncio.run(_generate_all(router.target, [prompt], configs[:1]))
    spread = [b - a for a, b in zip(before, _admitted(two_workers), strict=True)]
    assert sorted(spread) == [0, 12], spread
    chosen = spread.index(12)
    hits = load_report(two_workers[chosen].target).prefix_cache_hit_blocks - hits_before[chosen]
    assert hits >= 11 * 6  # every request after the first reused the 6 shared blocks


def test_high_priority_overtakes_queued_low_priority(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    """Both workers hold one request at a time; six low-priority requests saturate them and
    queue; a later high-priority request starts before every queued low-priority one."""
    long = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run(target: str) -> tuple[set[str], dict[str, float]]:
        first_token: dict[str, float] = {}
        async with AsyncClient(target) as client:

            async def one(name: str, priority: int) -> None:
                async for chunk in client.stream(f"{name} story", long, priority=priority):
                    if chunk.token_ids and name not in first_token:
                        first_token[name] = time.monotonic()

            lows = [asyncio.create_task(one(f"low{i}", 0)) for i in range(6)]
            while len(first_token) < 2:  # both workers busy, four lows queued
                await asyncio.sleep(0.005)
            running = set(first_token)
            await asyncio.gather(one("high", 10), *lows)
        return running, first_token

    with _router(two_workers, tmp_path, "--max-inflight-per-worker", "1") as router:
        running, first_token = asyncio.run(run(router.target))
    queued = set(first_token) - running - {"high"}
    assert len(running) == 2 and len(queued) == 4
    assert all(first_token["high"] < first_token[low] for low in queued), first_token


def test_high_priority_starts_at_once_when_the_worker_is_at_its_sequence_cap(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The worker runs two sequences at most and the router gives it two (as the router's
    docs advise); two long low-priority streams run, four wait. A high-priority request
    then passes the router's cap and preempts a running low one at the worker: it finishes
    before either of the two that were running (each needs 400 tokens), and starts before
    every waiting one. Without preemption at the cap it waited for a running one to end."""
    long = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
    short = GenerationConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    events: list[tuple[str, str]] = []  # (what, request) in the order the client saw them

    async def run(target: str) -> set[str]:
        async with AsyncClient(target) as client:

            async def one(name: str, priority: int, config: GenerationConfig) -> None:
                async for chunk in client.stream(f"{name} story", config, priority=priority):
                    if chunk.token_ids and ("first", name) not in events:
                        events.append(("first", name))
                events.append(("done", name))

            lows = [asyncio.create_task(one(f"low{i}", 0, long)) for i in range(6)]
            while len(events) < 2:  # two lows running, four waiting
                await asyncio.sleep(0.005)
            running = {name for _, name in events}
            await asyncio.gather(one("high", 10, short), *lows)
        return running

    with (
        _worker(tiny_model, tmp_path, "capped", "--max-num-seqs", "2") as worker,
        _router([worker], tmp_path, "--max-inflight-per-worker", "2") as router,
    ):
        running = asyncio.run(run(router.target))
        wait_all_blocks_free(worker.target)
    assert len(running) == 2
    order = events.index
    assert all(order(("done", "high")) < order(("done", low)) for low in running), events
    waiting = {f"low{i}" for i in range(6)} - running
    assert all(order(("first", "high")) < order(("first", low)) for low in waiting), events


def test_cancel_through_the_router_frees_worker_blocks(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    outgoing: queue.SimpleQueue[pb.GenerateRequest | None] = queue.SimpleQueue()
    config = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)
    outgoing.put(pb.GenerateRequest(request=wire.request_to_wire("c", "cancel me", config)))
    chunks: list[pb.Chunk] = []
    with _router(two_workers, tmp_path) as router, grpc.insecure_channel(router.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for response in stub.Generate(iter(outgoing.get, None), timeout=60):
            chunks.extend(response.chunks)
            if len(chunks) == 3:
                outgoing.put(pb.GenerateRequest(cancel=pb.Cancel(request_id="c")))
            if chunks[-1].finished:
                outgoing.put(None)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_CANCELLED
    assert 3 <= sum(len(c.token_ids) for c in chunks) < 450
    for worker in two_workers:
        report = wait_all_blocks_free(worker.target)
        assert report.free_kv_blocks == report.total_kv_blocks


def test_queue_full_is_resource_exhausted_with_retry_info(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    long = GenerationConfig(max_tokens=300, temperature=0.0, ignore_eos=True)
    args = ("--max-inflight-per-worker", "1", "--max-queued-requests", "1")
    with _router(two_workers, tmp_path, *args) as router:

        async def run() -> list[object]:
            async with AsyncClient(router.target) as client:
                # The workers are stopped meanwhile, so the two that run cannot finish (a
                # tiny model's 300 tokens can take less than the wait below).
                with stopped(*two_workers):
                    running = [
                        asyncio.create_task(client.generate(f"r{i}", long)) for i in range(3)
                    ]
                    await asyncio.sleep(0.3)  # two run, one waits: the queue is full
                    with pytest.raises(ResourceExhaustedError) as in_band:
                        await client.generate("one too many", long)
                    # GenerateOne carries the same refusal as the RPC status, with RetryInfo.
                    with grpc.insecure_channel(router.target) as channel:
                        stub = generation_pb2_grpc.GenerationStub(channel)
                        with pytest.raises(grpc.RpcError) as rpc:
                            request = wire.request_to_wire("x", "y", long)
                            list(stub.GenerateOne(request, timeout=10))
                    for task in running:
                        task.cancel()
                return [in_band.value, status.from_rpc_error(rpc.value)]

        errors = asyncio.run(run())
    for error in errors:
        assert isinstance(error, ResourceExhaustedError), error
        assert error.retry_after_s == pytest.approx(1.0)
        assert "queue is full" in str(error)


def test_no_healthy_worker_is_unavailable(tmp_path: Path) -> None:
    router = start_router(["127.0.0.1:9"], log_path=tmp_path / "router.log")
    refused = pytest.raises(UnavailableError, match="no healthy")
    with router, Client(router.target) as client, refused:
        client.generate("hello", GenerationConfig(max_tokens=2))


def test_kill_9_of_a_worker_mid_stream_loses_and_repeats_nothing(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """50 streams (greedy and seeded sampling) over two workers; one worker is killed with
    SIGKILL mid-generation. Every stream completes and equals the run without a failure."""
    prompts: list[str | list[int]] = [f"failover story {i}" for i in range(50)]
    configs = [
        GenerationConfig(max_tokens=80, temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else GenerationConfig(max_tokens=80, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(50)
    ]
    want = [r.token_ids for r in offline.generate(prompts, configs)]  # type: ignore[arg-type]

    a, b = _worker(tiny_model, tmp_path, "a"), _worker(tiny_model, tmp_path, "b")
    with a, b, _router([a, b], tmp_path) as router:

        async def run() -> list[list[int]]:
            async with AsyncClient(router.target) as client:
                streamed: dict[int, list[int]] = {i: [] for i in range(50)}

                async def one(i: int) -> None:
                    async for chunk in client.stream(prompts[i], configs[i]):
                        streamed[i].extend(chunk.token_ids)

                tasks = [asyncio.create_task(one(i)) for i in range(50)]
                while sum(map(len, streamed.values())) < 50 * 10:
                    await asyncio.sleep(0.01)
                assert load_report(b.target).running_requests > 0  # b is mid-generation
                b.proc.send_signal(signal.SIGKILL)
                await asyncio.gather(*tasks)
                return [streamed[i] for i in range(50)]

        got = asyncio.run(run())
    assert [len(tokens) for tokens in got] == [80] * 50
    assert got == want
    log = (tmp_path / "router.log").read_text()
    assert log.count("resuming request") >= 5, log[-2000:]  # b's streams really moved to a


def test_timeout_through_the_router_frees_worker_blocks(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    long = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)
    with _router(two_workers, tmp_path) as router, Client(router.target) as client:
        with pytest.raises(DeadlineExceededError, match=r"timeout of 0\.2 s"):
            for number, _ in enumerate(client.stream("slow", long, timeout=0.2)):
                if number == 0:  # under way: the timeout passes while it runs
                    pause(0.4, router, *two_workers)
        assert len(client.generate("next", GREEDY).token_ids) == 40  # the stream carries on
    for worker in two_workers:
        report = wait_all_blocks_free(worker.target)
        assert report.free_kv_blocks == report.total_kv_blocks


def test_router_sigterm_drains_in_flight_requests(
    two_workers: list[ServerProcess], tmp_path: Path
) -> None:
    long = GenerationConfig(max_tokens=300, temperature=0.0, ignore_eos=True)
    router = _router(two_workers, tmp_path)
    with router, Client(router.target) as client:
        stream = client.stream("drain me", long)
        first = next(stream)
        router.proc.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 300
        assert router.proc.wait(timeout=30) == 0


def test_router_imports_no_torch() -> None:
    code = (
        "import sys, headrace.router.server, headrace.router.cli, headrace.sdk.cli;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_headrace_up_serves_through_a_router(tiny_model: Path, offline: LLM) -> None:
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headrace.sdk.cli",
            "up",
            "--num-workers",
            "2",
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert up.stdout is not None
        line = up.stdout.readline()
        match = re.search(r"router on (\S+), workers (\S+), (\S+)$", line.strip())
        assert match, line
        assert wait_serving(match.group(1))
        with Client(match.group(1)) as client:
            assert client.generate("hello", GREEDY).token_ids == (
                offline.generate("hello", GREEDY)[0].token_ids
            )
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0


def test_workers_found_through_dns(two_workers: list[ServerProcess], tmp_path: Path) -> None:
    """`--workers-dns localhost:PORT` resolves to the worker on that port."""
    port = two_workers[0].port
    with launch.ServerProcess(
        ["router", "--workers-dns", f"localhost:{port}"], tmp_path / "router.log"
    ) as router:
        assert wait_serving(router.target)
        with Client(router.target) as client:
            assert len(client.generate("hello", GREEDY).token_ids) == 40


def test_a_worker_that_comes_back_returns_to_rotation(tiny_model: Path, tmp_path: Path) -> None:
    """The only worker dies: requests get UNAVAILABLE; it restarts on the same port: the
    router serves again without being restarted."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["worker", "--model", str(tiny_model)]

    def worker() -> ServerProcess:
        return launch.ServerProcess(args, tmp_path / "worker.log", port=port)

    first = worker()
    with start_router([first.target], log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)
        with Client(router.target) as client:
            assert len(client.generate("hello", GREEDY).token_ids) == 40
        first.proc.send_signal(signal.SIGKILL)
        first.kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with Client(router.target) as client:
                try:
                    client.generate("hello", GREEDY)
                except UnavailableError:
                    break
            time.sleep(0.1)
        else:
            raise AssertionError("the router kept serving with its only worker dead")
        with worker():
            assert wait_serving(router.target)
            with Client(router.target) as client:
                assert len(client.generate("hello again", GREEDY).token_ids) == 40
