"""``headrace bench serve``: load against a running router or worker, or what serving costs.

    headrace bench serve --target localhost:50051 --num-requests 500 --request-rate 20
    headrace bench serve --target localhost:50051 --max-concurrency 64 --output-lens 64-256
    headrace bench serve            # no target: a tiny worker and a router, started here

With ``--target`` it sends ``--num-requests`` random-token prompts (lengths uniform in
``--prompt-lens``, outputs uniform in ``--output-lens``, greedy, ignore_eos) through the SDK's
one multiplexed stream, arriving as a Poisson process at ``--request-rate`` per second (inf:
all at once), at most ``--max-concurrency`` in flight, and reports tok/s (generated tokens
over the run's wall time), TTFT (request sent -> first token) and ITL (between a request's
successive chunks), p50 and p99. ``--priority-burst N`` adds N priority-10 requests sent
all at once ``--burst-delay`` seconds in (while the load saturates the server) and reports
their TTFT apart (``burst_ttft_p50_ms``): how fast priority cuts in under load.

Without a target it starts a worker (the tiny random model unless ``--model``) and a router
in front of it, and runs the same load ``--rounds`` times each way, alternating: in-process
through `AsyncEngine` (the baseline), through the worker over gRPC, and through the router.
``ratio_direct_in_process`` and ``ratio_router_direct`` compare the best rounds' tok/s.
With ``--api openai`` a fourth way goes through the router's OpenAI-compatible HTTP door
(`serve_http`): ``ratio_http_grpc`` compares it with the router over gRPC, and
``http_added_ttft_p50_ms`` is the TTFT it adds. With ``--target``, ``--api openai`` loads
the door at ``--http-target`` instead of gRPC.

With ``--baseline vllm`` or ``llama.cpp`` it starts that peer's own OpenAI server beside
headrace's and loads the two doors in turns (`serve_peers`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.sdk.cli import build_parser
from headrace.sdk.client import AsyncClient
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.bench.common import Report, Summary, Workload, make_workload
from headrace.worker.config import EngineConfig, worker_engine_config

if TYPE_CHECKING:
    from headrace.worker.engine.async_engine import AsyncEngine


@dataclass(slots=True)
class Timings:
    """What one request saw, in seconds."""

    num_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    #: The completion's text, where the load keeps it (`serve_http`'s ``keep_text``).
    text: str = ""


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """When each request is sent, from the run's start: a Poisson process, or all at 0."""
    if rate == float("inf"):
        return [0.0] * num_requests
    rng, now, offsets = random.Random(seed), 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


async def run_load(
    target: str,
    workload: Workload,
    args: argparse.Namespace,
    name: str = "load",
    burst: Workload | None = None,
) -> tuple[Report, Report | None]:
    """Send the workload to ``target`` over one SDK client; the report of the run, and of
    the ``burst`` (priority 10, sent all at once ``--burst-delay`` s in, past the
    concurrency limit) if given."""
    offsets = arrival_offsets(len(workload.prompts), args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(workload.prompts))

    async def one(client: AsyncClient, i: int, start: float) -> Timings:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        async with limit:
            return await stream_one(client, workload, i)

    async def urgent(client: AsyncClient, i: int, start: float) -> Timings:
        assert burst is not None
        await asyncio.sleep(max(0.0, start + args.burst_delay - time.perf_counter()))
        return await stream_one(client, burst, i, priority=10)

    async with AsyncClient(target) as client:
        await client.generate([100, 101], GenerationConfig(max_tokens=1))  # open the stream
        start = time.perf_counter()
        runs = [one(client, i, start) for i in range(len(offsets))]
        runs += [urgent(client, i, start) for i in range(len(burst.prompts) if burst else 0)]
        results = await asyncio.gather(*runs)
    report = timings_report(name, start, results[: len(offsets)])
    if burst is None:
        return report, None
    return report, timings_report("priority-10 burst", start, results[len(offsets) :])


async def stream_one(client: AsyncClient, workload: Workload, i: int, priority: int = 0) -> Timings:
    """Stream request i of the workload (greedy, ignore_eos); what it saw."""
    config = GenerationConfig(max_tokens=workload.max_tokens[i], temperature=0, ignore_eos=True)
    timings = Timings()
    last = sent = time.perf_counter()
    async for chunk in client.stream(workload.prompts[i], config, priority=priority):
        now = time.perf_counter()
        if chunk.token_ids and timings.ttft_s is None:
            timings.ttft_s = now - sent
        elif chunk.token_ids:
            timings.itl_s.append(now - last)
        last = now
        timings.num_tokens += len(chunk.token_ids)
    return timings


def timings_report(name: str, start: float, results: list[Timings]) -> Report:
    return Report(
        name,
        time.perf_counter() - start,
        sum(r.num_tokens for r in results),
        ttft_s=[r.ttft_s for r in results if r.ttft_s is not None],
        itl_s=[gap for r in results for gap in r.itl_s],
        texts=[r.text for r in results],
    )


async def run_in_process(engine: AsyncEngine, workload: Workload, round_no: int) -> Report:
    """The baseline: the same workload straight into the engine's streaming API."""

    async def one(i: int) -> Timings:
        config = GenerationConfig(max_tokens=workload.max_tokens[i], temperature=0, ignore_eos=True)
        timings, last = Timings(), time.perf_counter()
        sent = last
        async for output in engine.generate(f"r{round_no}-{i}", workload.prompts[i], config):
            now = time.perf_counter()
            num_new = sum(len(delta.token_ids) for delta in output.samples)
            if num_new and timings.ttft_s is None:
                timings.ttft_s = now - sent
            elif num_new:
                timings.itl_s.append(now - last)
            last, timings.num_tokens = now, timings.num_tokens + num_new
        return timings

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(workload.prompts))))
    return timings_report(IN_PROCESS, start, results)


IN_PROCESS, DIRECT, ROUTED = "in-process AsyncEngine", "gRPC worker + SDK", "router -> worker + SDK"
HTTP = "router HTTP (OpenAI door)"


def run(args: argparse.Namespace) -> Summary:
    if args.target and args.worker_args:
        raise InvalidArgumentError(
            "--worker-args", "sets the worker bench serve starts; --target names a running one"
        )
    if args.baseline != "none":
        from headrace.worker.bench.serve_peers import run_against_peer

        return run_against_peer(args)
    if args.target is None:
        from headrace.worker.bench.serve_local import run_local

        return run_local(args)
    info = _model_info(args.target)
    workload = make_workload(
        info.vocab_size, args.num_requests, args.prompt_lens, args.output_lens, args.seed
    )
    print(describe_workload(args, info.name))
    if args.api == "openai":
        from headrace.worker.bench.serve_http import run_http_load

        http_target = door_target(args)
        report = asyncio.run(run_http_load(http_target, workload, args))
        burst_report = None
    else:
        burst = None
        if args.priority_burst:
            burst = make_workload(
                info.vocab_size,
                args.priority_burst,
                args.prompt_lens,
                args.output_lens,
                args.seed + 1,
            )
        report, burst_report = asyncio.run(run_load(args.target, workload, args, burst=burst))
    print(report.describe())
    summary: Summary = {"bench": "serve", "target": args.target, "model": info.name}
    summary.update(report.summary())
    if burst_report is not None:
        print(burst_report.describe())
        summary.update({f"burst_{k}": v for k, v in burst_report.summary().items()})
    return summary


def door_target(args: argparse.Namespace) -> str:
    """The OpenAI door of the server at --target: --http-target, or --target's host, port 8000."""
    return str(args.http_target or f"{args.target.rpartition(':')[0]}:8000")


def _model_info(target: str) -> pb.ModelInfo:
    async def ask() -> pb.ModelInfo:
        async with AsyncClient(target) as client:
            return await client.model_info()

    return asyncio.run(ask())


def worker_flags(
    args: argparse.Namespace, model: str, max_num_seqs: int
) -> tuple[list[str], EngineConfig]:
    """The flags of the worker `bench serve` starts (its dtype and room for the load, then
    ``--worker-args``, whose flags win), and the engine they make, checked as the worker
    checks them before anything starts: an unknown or bad flag exits, naming it."""
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(max_num_seqs)]
    flags += shlex.split(args.worker_args)
    parsed = build_parser().parse_args(["worker", "--model", model, *flags])
    return flags, worker_engine_config(parsed)


def describe_workload(args: argparse.Namespace, model: str) -> str:
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"
    return (
        f"workload: {args.num_requests} requests ({rate}, concurrency "
        f"{args.max_concurrency or 'unlimited'}), prompts {args.prompt_lens[0]}-"
        f"{args.prompt_lens[1]} tokens, outputs {args.output_lens[0]}-{args.output_lens[1]} "
        f"tokens; model {model}"
    )
