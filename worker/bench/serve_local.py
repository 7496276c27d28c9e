"""``headrace bench serve`` without a target: what gRPC and the router cost.

A worker process (the tiny random model unless ``--model``) and a router in front of it are
started here; the same load runs in-process through `AsyncEngine` (the baseline), through the
worker, and through the router, ``--rounds`` times each, alternating, and the best round of
each counts (these machines are noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import tempfile
from pathlib import Path

from headrace.sdk.launch import start_router, start_worker
from headrace.worker.bench.common import (
    TINY_MODEL,
    Report,
    Summary,
    build_tiny_checkpoint,
    make_workload,
    quantile,
)
from headrace.worker.bench.serve import (
    DIRECT,
    HTTP,
    IN_PROCESS,
    ROUTED,
    describe_workload,
    run_in_process,
    run_load,
    worker_flags,
)
from headrace.worker.bench.serve_http import run_http_load
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model


def run_local(args: argparse.Namespace) -> Summary:
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            model, name = (
                str(build_tiny_checkpoint(Path(tmp), resolve_model(DEFAULT_MODEL))),
                TINY_MODEL,
            )
        else:
            model = str(resolve_model(args.model))
            name = Path(model).name
        rounds = _run_rounds(args, model, name, Path(tmp))
    return _summary(rounds, name)


def _run_rounds(
    args: argparse.Namespace, model: str, name: str, tmp: Path
) -> dict[str, list[Report]]:
    max_num_seqs = max(256, args.max_concurrency or args.num_requests)
    # The in-process engine is the one the worker runs: the same flags make both.
    flags, config = worker_flags(args, model, max_num_seqs)
    engine = AsyncEngine(config)
    workload = make_workload(
        engine.vocab_size, args.num_requests, args.prompt_lens, args.output_lens, args.seed
    )
    print(describe_workload(args, name) + f", worker flags: {shlex.join(flags)}")
    worker = start_worker(model, *flags, log_path=tmp / "worker.log")
    router_args = ["--log-level", "warning"] + (
        ["--http-port", "0"] if args.api == "openai" else []
    )
    router = start_router([worker.target], *router_args, log_path=tmp / "router.log")
    rounds: dict[str, list[Report]] = {}
    try:
        with worker, router:
            numbers = itertools.count()
            for _ in range(args.rounds):
                results = [
                    asyncio.run(run_in_process(engine, workload, next(numbers))),
                    asyncio.run(run_load(worker.target, workload, args, DIRECT))[0],
                    asyncio.run(run_load(router.target, workload, args, ROUTED))[0],
                ]
                if router.http_port is not None:
                    door = f"127.0.0.1:{router.http_port}"
                    results.append(asyncio.run(run_http_load(door, workload, args, HTTP)))
                for result in results:
                    print(result.describe())
                    rounds.setdefault(result.name, []).append(result)
    finally:
        engine.shutdown()
    return rounds


def _summary(rounds: dict[str, list[Report]], model: str) -> Summary:
    best = {name: max(reports, key=lambda r: r.tokens_per_s) for name, reports in rounds.items()}
    direct_ratio = best[DIRECT].tokens_per_s / best[IN_PROCESS].tokens_per_s
    router_ratio = best[ROUTED].tokens_per_s / best[DIRECT].tokens_per_s
    print("best rounds: " + ", ".join(f"{n} {r.tokens_per_s:.1f} tok/s" for n, r in best.items()))
    print(f"gRPC + SDK / in-process: {direct_ratio:.2f}x; router / direct: {router_ratio:.2f}x")
    summary: Summary = {"bench": "serve", "model": model}
    summary.update(best[ROUTED].summary())
    added: Summary = {}
    for q in (0.5, 0.99):  # TTFT the router adds, per percentile over all rounds
        direct = quantile([t for r in rounds[DIRECT] for t in r.ttft_s], q)
        routed = quantile([t for r in rounds[ROUTED] for t in r.ttft_s], q)
        added[f"router_added_ttft_p{round(q * 100)}_ms"] = round((routed - direct) * 1e3, 3)
        label = f"TTFT p{round(q * 100)}"
        print(f"{label}: direct {direct * 1e3:.0f} ms, via router {routed * 1e3:.0f} ms")
    summary.update(added)
    summary["ratio_direct_in_process"] = round(direct_ratio, 3)
    summary["ratio_router_direct"] = round(router_ratio, 3)
    if HTTP in best:
        summary.update(_http_summary(rounds, best))
    return summary


def _http_summary(rounds: dict[str, list[Report]], best: dict[str, Report]) -> Summary:
    """The OpenAI door against the router's gRPC: tok/s ratio and the TTFT it adds."""
    ratio = best[HTTP].tokens_per_s / best[ROUTED].tokens_per_s
    grpc = quantile([t for r in rounds[ROUTED] for t in r.ttft_s], 0.5)
    http = quantile([t for r in rounds[HTTP] for t in r.ttft_s], 0.5)
    print(
        f"HTTP / router gRPC: {ratio:.2f}x; TTFT p50: gRPC {grpc * 1e3:.1f} ms, "
        f"HTTP {http * 1e3:.1f} ms"
    )
    return {
        "ratio_http_grpc": round(ratio, 3),
        "http_added_ttft_p50_ms": round((http - grpc) * 1e3, 3),
    }
