"""Real headrace server processes on loopback ports, and probes of their state."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from headrace.protos import worker_pb2, worker_pb2_grpc
from headrace.sdk import launch
from headrace.sdk.launch import ServerProcess, start_router
from headrace.sdk.serving import wait_serving

__all__ = [
    "ServerProcess",
    "load_report",
    "start_router",
    "start_worker",
    "wait_all_blocks_free",
    "wait_serving",
]


def start_worker(model: Path | str, log_dir: Path, *extra: str) -> ServerProcess:
    return launch.start_worker(model, *extra, log_path=log_dir / "worker.log")


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
