"""Start real headrace server processes on loopback ports for end-to-end tests."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from headrace.protos import worker_pb2, worker_pb2_grpc

_LISTENING = re.compile(r"serving .* on (\S+):(\d+)$")
START_TIMEOUT_S = 120.0


class ServerProcess:
    """`headrace <command> ... --port 0`; the port comes from the line it prints at start."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headrace.sdk.cli", *args, "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self.port = self._wait_for_port()
        self.target = f"127.0.0.1:{self.port}"

    def _wait_for_port(self) -> int:
        assert self.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline().decode().strip()
            match = _LISTENING.search(line)
            if match:
                return int(match.group(2))
            if not line and self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"server did not start; log:\n{self.log_path.read_text()[-4000:]}")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.proc.poll() is None:
            self.terminate()
        self.kill()


def start_worker(model: Path | str, log_dir: Path, *extra: str) -> ServerProcess:
    return ServerProcess(["worker", "--model", str(model), *extra], log_dir / "worker.log")


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
