"""`headrace worker --tensor-parallel-size/--pipeline-parallel-size`: real rank processes.

The worker serves the single-rank tokens; a rank that dies takes the worker down at once
(health NOT_SERVING, non-zero exit) and no process of it is left behind, whichever rank dies.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import start_router
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import (
    ServerProcess,
    load_report,
    start_worker,
    stream_through_a_fault,
    wait_serving,
    wait_workers_up,
)

PROMPTS = ["the quick brown fox", "a story about the sea", "to be or not", "hello"]
#: How soon after a rank dies the whole worker must be gone.
EXIT_WITHIN_S = 10.0


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def start_parallel_worker(
    model: Path, tmp_path: Path, *sizes: str
) -> tuple[ServerProcess, list[int]]:
    server = start_worker(model, tmp_path, *sizes)
    ranks = child_pids(server.proc.pid)
    return server, ranks


def test_parallel_worker_serves_the_single_rank_tokens(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    config = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in offline.generate(PROMPTS, config)]
    server, ranks = start_parallel_worker(tiny_model, tmp_path, "-tp", "2", "-pp", "2")
    with server:
        assert len(ranks) == 3 and all(alive(pid) for pid in ranks)
        with Client(server.target) as client:
            assert [client.generate(p, config).token_ids for p in PROMPTS] == expected
        assert server.terminate() == 0
    assert wait_gone(ranks, 5.0) == []


def test_a_rank_killed_mid_run_takes_the_worker_down(tiny_model: Path, tmp_path: Path) -> None:
    server, ranks = start_parallel_worker(tiny_model, tmp_path, "--tensor-parallel-size", "2")
    with server:
        statuses: queue.SimpleQueue[int] = queue.SimpleQueue()
        threading.Thread(target=watch_health, args=(server.target, statuses), daemon=True).start()
        streamed: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(target=stream_long, args=(server.target, streamed), daemon=True).start()
        streamed.get(timeout=30)  # tokens are flowing: the ranks are mid-step
        os.kill(ranks[0], signal.SIGKILL)
        code = server.proc.wait(timeout=EXIT_WITHIN_S)
        assert code != 0
        seen = []
        while not statuses.empty():
            seen.append(statuses.get())
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert wait_gone(ranks, 2.0) == []


def test_router_fails_over_when_a_rank_of_a_parallel_worker_dies(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """Streams spread over a single-rank worker and a TP=2 worker; one rank of the TP worker
    is killed mid-generation. Every stream completes, equal to the run without a failure."""
    prompts = [f"failover story {i}" for i in range(20)]
    config = GenerationConfig(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in offline.generate(prompts, config)]
    (tmp_path / "a").mkdir()
    single = start_worker(tiny_model, tmp_path / "a")
    parallel, ranks = start_parallel_worker(tiny_model, tmp_path, "-tp", "2")
    router = start_router([single.target, parallel.target], log_path=tmp_path / "router.log")
    with single, parallel, router:
        assert wait_serving(router.target)
        wait_workers_up(tmp_path / "router.log", single.target, parallel.target)

        def kill_a_rank() -> None:
            assert load_report(parallel.target).running_requests > 0
            os.kill(ranks[0], signal.SIGKILL)

        got = stream_through_a_fault(router.target, prompts, config, kill_a_rank)
        assert parallel.proc.wait(timeout=EXIT_WITHIN_S) != 0
    assert got == want
    assert "resuming request" in (tmp_path / "router.log").read_text()


def test_killing_rank_zero_leaves_no_rank_behind(tiny_model: Path, tmp_path: Path) -> None:
    server, ranks = start_parallel_worker(tiny_model, tmp_path, "-pp", "2")
    with server:
        server.proc.kill()
        server.proc.wait()
        assert wait_gone(ranks, EXIT_WITHIN_S) == []


def test_a_size_the_model_cannot_split_is_a_clear_cli_error(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "headrace.sdk.cli", "worker", "--model", str(tiny_model)]
    done = subprocess.run([*command, "-tp", "3", "--port", "0"], capture_output=True, timeout=120)
    assert done.returncode == 1
    assert (
        "headrace: error: tensor_parallel_size: 3: num_attention_heads (4) is not divisible"
        in done.stderr.decode()
    )


def watch_health(target: str, statuses: queue.SimpleQueue[int]) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for response in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                statuses.put(response.status)
        except grpc.RpcError:
            pass  # the worker is gone


def stream_long(target: str, streamed: queue.SimpleQueue[object]) -> None:
    config = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        with Client(target) as client:
            for chunk in client.stream("a long one", config):
                streamed.put(chunk)
    except Exception:
        streamed.put(None)
