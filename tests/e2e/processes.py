"""Real headrace server processes on loopback ports, and probes of their state."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from headrace.protos import worker_pb2, worker_pb2_grpc
from headrace.sdk import launch
from headrace.sdk.client import AsyncClient
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import ServerProcess, start_router
from headrace.sdk.serving import wait_serving

__all__ = [
    "ServerProcess",
    "finished_request",
    "http_door",
    "load_report",
    "num_log_lines",
    "pause",
    "start_router",
    "start_worker",
    "stopped",
    "stream_through_a_fault",
    "two_workers_behind_a_router",
    "wait_all_blocks_free",
    "wait_for_text",
    "wait_serving",
    "wait_workers_up",
]


def start_worker(model: Path | str, log_dir: Path, *extra: str) -> ServerProcess:
    return launch.start_worker(model, *extra, log_path=log_dir / "worker.log")


@contextlib.contextmanager
def two_workers_behind_a_router(
    model: Path | str, tmp_path: Path
) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess]]:
    """(router, worker a, worker b), serving; logs in tmp_path/a, tmp_path/b and
    tmp_path/router.log (a failover test kills b and reads the router's log)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = start_worker(model, tmp_path / "a"), start_worker(model, tmp_path / "b")
    with a, b, start_router([a.target, b.target], log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)
        yield router, a, b


@contextlib.contextmanager
def http_door(
    model: Path | str, log_dir: Path, *worker_args: str
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """(worker, router): a worker serving ``model`` behind a router with its OpenAI door on
    a free port, serving; logs in log_dir."""
    with (
        start_worker(model, log_dir, *worker_args) as worker,
        start_router(
            [worker.target], "--http-port", "0", log_path=log_dir / "router.log"
        ) as router,
    ):
        assert wait_serving(router.target)
        yield worker, router


def load_report(target: str) -> worker_pb2.LoadReport:
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerControlStub(channel)
        call = stub.WatchLoad(worker_pb2.WatchLoadRequest(), timeout=10)
        report: worker_pb2.LoadReport = next(iter(call))
        call.cancel()
        return report


def wait_all_blocks_free(target: str, timeout_s: float = 10.0) -> worker_pb2.LoadReport:
    """Poll the load report until every KV block is free (or the timeout passes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = load_report(target)
        idle = report.running_requests == 0 and report.waiting_requests == 0
        if (idle and report.free_kv_blocks == report.total_kv_blocks) or (
            time.monotonic() > deadline
        ):
            return report
        time.sleep(0.05)


def num_log_lines(server: ServerProcess) -> int:
    """The lines in the server's log now: what `finished_request` looks past."""
    assert server.log_path is not None
    return len(server.log_path.read_text().splitlines())


def finished_request(
    server: ServerProcess, marker: str, after: int, timeout_s: float = 10.0
) -> dict[str, str]:
    """The fields of the first ``request finished`` line with ``marker`` past the first
    ``after`` lines of the server's log (`sdk.telemetry.log_request`'s key=value pairs,
    quoted where a value needs it), waiting for it up to ``timeout_s``."""
    assert server.log_path is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = server.log_path.read_text().splitlines()[after:]
        found = [line for line in lines if "request finished " in line and marker in line]
        if found:
            pairs = shlex.split(found[0].split("request finished ", 1)[1])
            return dict(pair.split("=", 1) for pair in pairs)
        time.sleep(0.05)
    raise AssertionError(f"no new request finished line with {marker!r}")


@contextlib.contextmanager
def stopped(*processes: ServerProcess) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block, then resumed in the order given, even
    when it fails: their requests neither finish nor move on meanwhile, where a tiny model on
    a fast CPU can otherwise finish a long request (450 tokens in 0.17 s on a Zen 4) before
    the timeout, queue or fault it was meant to outlast."""
    for process in processes:
        process.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.proc.send_signal(signal.SIGCONT)


def pause(seconds: float, *processes: ServerProcess) -> None:
    """The processes `stopped` for ``seconds``: a deadline test pauses the servers once a
    request is under way, so that its timeout passes while the request runs."""
    with stopped(*processes):
        time.sleep(seconds)


def wait_for_text(path: Path, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in (log := path.read_text()):
            return log
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s} s")


def wait_workers_up(router_log: Path, *targets: str) -> None:
    """Wait until the router has taken every one of ``targets`` into rotation: its health
    says SERVING once the first is up, and a burst sent before the others are would all go
    to that one."""
    for target in targets:
        wait_for_text(router_log, f"worker {target} is up")


def stream_through_a_fault(
    target: str, prompts: list[str], config: GenerationConfig, fault: Callable[[], None]
) -> list[list[int]]:
    """Stream every prompt through ``target`` at once; once about 10 tokens per stream have
    arrived (the workers are mid-generation), call ``fault``; each stream's tokens when all
    have ended (a router resumes the interrupted ones elsewhere)."""

    async def run() -> list[list[int]]:
        async with AsyncClient(target) as client:
            streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

            async def one(i: int) -> None:
                async for chunk in client.stream(prompts[i], config):
                    streamed[i].extend(chunk.token_ids)

            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            while sum(map(len, streamed.values())) < len(prompts) * 10:
                await asyncio.sleep(0.01)
            fault()
            await asyncio.gather(*tasks)
            return [streamed[i] for i in range(len(prompts))]

    return asyncio.run(run())
