"""What gRPC and the router cost: the same workload through the in-process streaming API,
through a worker process + the SDK, and through a router in front of that worker.

    python -m headrace.worker.bench.serve            # tiny model, 256 concurrent requests
    python -m headrace.worker.bench.serve --model smollm2-135m-instruct --num-requests 64

The tiny model (2 layers, hidden 64, the default model's tokenizer) makes the engine cheap,
so the serving path's own overhead shows. Both sides run every request to max_tokens
(ignore_eos, greedy) and count the tokens they receive; each side runs `--rounds` times,
alternating, and the best round counts (the machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

from headrace.sdk.client import AsyncClient
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import start_router, start_worker
from headrace.worker.bench.engine import (
    Report,
    Workload,
    build_tiny_checkpoint,
    make_workload,
    quantile,
)
from headrace.worker.config import EngineConfig
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model


def _config(workload: Workload) -> GenerationConfig:
    return GenerationConfig(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)


async def run_in_process(engine: AsyncEngine, workload: Workload, round_no: int) -> Report:
    config = _config(workload)

    async def one(i: int, prompt: list[int], start: float) -> tuple[int, float]:
        num_tokens, first = 0, 0.0
        async for output in engine.generate(f"r{round_no}-{i}", prompt, config):
            if num_tokens == 0:
                first = time.perf_counter() - start
            num_tokens += sum(len(delta.token_ids) for delta in output.samples)
        return num_tokens, first

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, p, start) for i, p in enumerate(workload.prompts)))
    return _round("in-process AsyncEngine", start, results)


async def run_grpc(target: str, workload: Workload, name: str) -> Report:
    config = _config(workload)

    async def one(client: AsyncClient, prompt: list[int], start: float) -> tuple[int, float]:
        num_tokens, first = 0, 0.0
        async for chunk in client.stream(prompt, config):
            if num_tokens == 0:
                first = time.perf_counter() - start
            num_tokens += len(chunk.token_ids)
        return num_tokens, first

    async with AsyncClient(target) as client:
        await client.generate([100, 101], GenerationConfig(max_tokens=1))  # open the stream
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, p, start) for p in workload.prompts))
    return _round(name, start, results)


def _round(name: str, start: float, results: list[tuple[int, float]]) -> Report:
    seconds = time.perf_counter() - start
    return Report(name, seconds, sum(n for n, _ in results), [t for _, t in results])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m headrace.worker.bench.serve")
    parser.add_argument("--model", default=None, help="default: a tiny random model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model = str(build_tiny_checkpoint(Path(tmp), resolve_model(DEFAULT_MODEL)))
        else:
            model = str(resolve_model(args.model))
        engine_args = ["--dtype", args.dtype, "--max-num-seqs", str(max(256, args.num_requests))]
        engine = AsyncEngine(
            EngineConfig(model=model, dtype=args.dtype, max_num_seqs=max(256, args.num_requests))
        )
        workload = make_workload(
            engine.engine.vocab_size, args.num_requests, 16, 64, args.max_tokens, seed=0
        )
        print(
            f"workload: {args.num_requests} concurrent requests, prompts 16-64 tokens, "
            f"{args.max_tokens} new tokens each, model {Path(model).name}, dtype {args.dtype}"
        )
        rounds: dict[str, list[Report]] = {}
        worker = start_worker(model, *engine_args, log_path=Path(tmp) / "worker.log")
        router = start_router(
            [worker.target], "--log-level", "warning", log_path=Path(tmp) / "router.log"
        )
        with worker, router:
            numbers = itertools.count()
            for _ in range(args.rounds):
                for result in (
                    asyncio.run(run_in_process(engine, workload, next(numbers))),
                    asyncio.run(run_grpc(worker.target, workload, DIRECT)),
                    asyncio.run(run_grpc(router.target, workload, ROUTED)),
                ):
                    print(result.describe())
                    rounds.setdefault(result.name, []).append(result)
        engine.shutdown()
    _summary(rounds)


DIRECT, ROUTED, IN_PROCESS = "gRPC worker + SDK", "router -> worker + SDK", "in-process AsyncEngine"


def _summary(rounds: dict[str, list[Report]]) -> None:
    best = {name: max(rs, key=lambda r: r.tokens_per_s) for name, rs in rounds.items()}
    print("best rounds: " + ", ".join(f"{n} {r.tokens_per_s:.1f} tok/s" for n, r in best.items()))
    print(
        f"gRPC + SDK / in-process: {best[DIRECT].tokens_per_s / best[IN_PROCESS].tokens_per_s:.2f}x"
    )
    print(f"router / direct: {best[ROUTED].tokens_per_s / best[DIRECT].tokens_per_s:.2f}x")
    # TTFT the router adds: per percentile, routed minus direct, over all rounds.
    for q in (0.5, 0.99):
        direct = quantile([t for r in rounds[DIRECT] for t in r.ttft_s], q)
        routed = quantile([t for r in rounds[ROUTED] for t in r.ttft_s], q)
        print(
            f"TTFT p{round(q * 100)}: direct {direct * 1e3:.0f} ms, via router "
            f"{routed * 1e3:.0f} ms, added {(routed - direct) * 1e3:+.0f} ms"
        )


if __name__ == "__main__":
    main()
