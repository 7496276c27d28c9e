"""A real Envoy (deploy/envoy/envoy.yaml) in front of a real router and worker, on loopback:
the SDK streams through it, cancels and deadlines keep their meaning, health answers."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import DeadlineExceededError
from headrace.sdk.launch import start_router

from tests.deploy.manifests import envoy_binary, envoy_config
from tests.e2e.processes import ServerProcess, wait_all_blocks_free, wait_serving

pytestmark = pytest.mark.timeout(300)

GREEDY = GenerationConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
#: Long enough that it is still running when cancelled or timed out (the context is 512).
LONG = GenerationConfig(max_tokens=480, temperature=0.0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def router(
    worker: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("envoy-router")
    with start_router([worker.target], log_path=logs / "router.log") as process:
        assert wait_serving(process.target)
        yield process


@pytest.fixture(scope="module")
def envoy(router: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Envoy's listener address, once it routes health checks to the router."""
    folder = tmp_path_factory.mktemp("envoy")
    port, admin_port = _free_port(), _free_port()
    config = folder / "envoy.yaml"
    config.write_text(yaml.safe_dump(envoy_config(port, router.port, admin_port)))
    log = (folder / "envoy.log").open("wb")
    process = subprocess.Popen(
        [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--concurrency", "1",
         "-l", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    target = f"127.0.0.1:{port}"
    try:
        assert wait_serving(target, timeout_s=60), (folder / "envoy.log").read_text()[-3000:]
        yield target
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_health_answers_through_envoy(envoy: str) -> None:
    with grpc.insecure_channel(envoy) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_streams_through_envoy_equal_the_router_direct(envoy: str, router: ServerProcess) -> None:
    prompts: list[str | list[int]] = ["Hello there", [11, 12, 13, 14], "a b c d e f"]

    async def run(target: str) -> list[list[int]]:
        async with AsyncClient(target) as client:
            results = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts))
        return [result.token_ids for result in results]

    through_envoy = asyncio.run(run(envoy))
    assert through_envoy == asyncio.run(run(router.target))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in through_envoy)


def _log_line(server: ServerProcess, marker: str, timeout_s: float = 10.0) -> str:
    assert server.log_path is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in server.log_path.read_text().splitlines() if marker in line]
        if lines:
            return lines[-1]
        time.sleep(0.05)
    raise AssertionError(f"no log line with {marker!r}")


def test_cancel_through_envoy_frees_the_workers_blocks(
    envoy: str, router: ServerProcess, worker: ServerProcess
) -> None:
    with Client(envoy) as client:
        stream = client.stream([21, 22, 23], LONG)
        received = [next(stream) for _ in range(3)]
        stream.close()  # leaving early sends Cancel on the SDK's stream, through Envoy
    assert all(chunk.token_ids for chunk in received)
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks
    assert report.running_requests == report.waiting_requests == 0
    # It was cancelled, not run to the end: the worker and the router both say so.
    for server in (worker, router):
        line = _log_line(server, "prompt_tokens=3 ")
        assert "finish_reason=abort" in line, line
        generated = int(line.split("generated_tokens=")[1].split()[0])
        assert generated < LONG.max_tokens


def test_deadlines_through_envoy_are_deadline_exceeded(envoy: str, worker: ServerProcess) -> None:
    # The request's own timeout, enforced by the router: an in-band DEADLINE_EXCEEDED.
    with Client(envoy) as client, pytest.raises(DeadlineExceededError):
        client.generate([31, 32, 33], LONG, timeout=0.3)
    # A gRPC deadline on GenerateOne: the grpc-timeout header passes Envoy untouched.
    request = pb.Request(request_id="deadline", token_ids=pb.TokenIds(ids=[41, 42, 43]))
    request.config.max_tokens = LONG.max_tokens
    request.config.ignore_eos = True
    with grpc.insecure_channel(envoy) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.GenerateOne(request, timeout=0.5))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(worker.target)
