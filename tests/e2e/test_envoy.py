"""A real Envoy (deploy/envoy/envoy.yaml) in front of a real router (serving TLS, as deployed)
and worker, on loopback: the SDK streams through it, cancels and deadlines keep their meaning,
health answers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from tests.e2e.processes import (
    ServerProcess,
    finished_request,
    num_log_lines,
    pause,
    stopped,
    wait_all_blocks_free,
    wait_serving,
)
from tests.e2e.security import Pki

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
    worker: ServerProcess, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A router serving TLS, as in deploy/k8s (Envoy checks its certificate)."""
    logs = tmp_path_factory.mktemp("envoy-router")
    tls = ["--tls-cert", str(pki.router.cert), "--tls-key", str(pki.router.key)]
    with start_router(
        [worker.target], *tls, "--health-port", "0", log_path=logs / "router.log"
    ) as process:
        assert wait_serving(f"127.0.0.1:{process.health_port}")
        yield process


@dataclass(frozen=True, slots=True)
class Envoy:
    target: str  # the listener, HOST:PORT
    admin_url: str

    def stat(self, name: str) -> int:
        """One counter from the admin interface's /stats."""
        url = f"{self.admin_url}/stats?filter=^{name}$"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        return int(text.split(":")[1]) if ":" in text else 0


def _connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    (manager,) = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    typed_config: dict[str, Any] = manager["typed_config"]
    return typed_config


@contextlib.contextmanager
def _run_envoy(config: dict[str, Any], folder: Path) -> Iterator[Envoy]:
    """Envoy with ``config``, once it routes health checks to the router; stopped after."""
    (folder / "envoy.yaml").write_text(yaml.safe_dump(config))
    log_path = folder / "envoy.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [envoy_binary(), "-c", str(folder / "envoy.yaml"), "--use-dynamic-base-id",
             "--concurrency", "1", "-l", "warning"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
            admin = config["admin"]["address"]["socket_address"]
            envoy = Envoy(
                f"127.0.0.1:{listener['port_value']}", f"http://127.0.0.1:{admin['port_value']}"
            )
            assert wait_serving(envoy.target, timeout_s=60), log_path.read_text()[-3000:]
            yield envoy
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def envoy(
    router: ServerProcess, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The listener of an Envoy with deploy/envoy/envoy.yaml as shipped (but on loopback)."""
    config = envoy_config(_free_port(), router.port, _free_port(), pki.ca.cert)
    with _run_envoy(config, tmp_path_factory.mktemp("envoy")) as running:
        yield running.target


def test_health_answers_through_envoy(envoy: str) -> None:
    with grpc.insecure_channel(envoy) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_streams_through_envoy_equal_the_router_direct(
    envoy: str, router: ServerProcess, pki: Pki
) -> None:
    prompts: list[str | list[int]] = ["Hello there", [11, 12, 13, 14], "a b c d e f"]

    async def run(target: str, **options: Any) -> list[list[int]]:
        async with AsyncClient(target, **options) as client:
            results = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts))
        return [result.token_ids for result in results]

    through_envoy = asyncio.run(run(envoy))
    assert through_envoy == asyncio.run(run(router.target, root_certificates=pki.ca.cert_pem))
    assert all(len(tokens) == GREEDY.max_tokens for tokens in through_envoy)


def test_cancel_through_envoy_frees_the_workers_blocks(
    envoy: str, router: ServerProcess, worker: ServerProcess
) -> None:
    logged = {server: num_log_lines(server) for server in (worker, router)}
    with Client(envoy) as client:
        stream = client.stream([21, 22, 23, 24, 25, 26, 27], LONG)
        received = [next(stream) for _ in range(3)]
        stream.close()  # leaving early sends Cancel on the SDK's stream, through Envoy
    assert all(chunk.token_ids for chunk in received)
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks
    assert report.running_requests == report.waiting_requests == 0
    # It was cancelled, not run to the end: the worker and the router both say so.
    for server, after in logged.items():
        request = finished_request(server, "prompt_tokens=7 ", after)
        assert request["finish_reason"] == "abort", request
        assert int(request["generated_tokens"]) < LONG.max_tokens


def test_a_request_timeout_through_envoy_is_deadline_exceeded(
    envoy: str, worker: ServerProcess
) -> None:
    """The request's own timeout, enforced by the router, comes back in-band: Envoy cannot
    have made it up. The worker is stopped meanwhile: a tiny model's 480 tokens can take
    less than the timeout."""
    with stopped(worker), Client(envoy) as client, pytest.raises(DeadlineExceededError):
        client.generate([31, 32, 33], LONG, timeout=0.3)
    wait_all_blocks_free(worker.target)


def _chunks_until_deadline(
    target: str, token_ids: list[int], deadline_s: float, streaming: threading.Event
) -> tuple[int, grpc.StatusCode]:
    """GenerateOne with a gRPC deadline: how many chunks came, and the final status; sets
    ``streaming`` at the first chunk."""
    request = pb.Request(request_id="deadline", token_ids=pb.TokenIds(ids=token_ids))
    request.config.max_tokens = LONG.max_tokens
    request.config.ignore_eos = True
    num_chunks = 0
    with grpc.insecure_channel(target) as channel:
        try:
            for _ in generation_pb2_grpc.GenerationStub(channel).GenerateOne(
                request, timeout=deadline_s
            ):
                num_chunks += 1
                streaming.set()
        except grpc.RpcError as error:
            return num_chunks, error.code()
    return num_chunks, grpc.StatusCode.OK


def test_regression_grpc_deadline_mid_stream_through_envoy_is_not_internal(
    envoy: str, worker: ServerProcess
) -> None:
    """A gRPC deadline that passes while tokens stream is DEADLINE_EXCEEDED.

    Envoy honouring grpc-timeout itself (max_stream_duration.grpc_timeout_header_max) races
    the client and the router, and when it wins mid-stream it can only reset the stream:
    the client saw INTERNAL ("RST_STREAM with error code 2") in some of the calls. Many
    calls at once make that race very likely to show. The worker is paused once tokens
    stream, so the deadline passes mid-stream even where the calls could finish before it.
    """
    num_calls = 16
    streaming = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=num_calls) as pool:
        calls = [
            pool.submit(_chunks_until_deadline, envoy, [61 + i, 62, 63], 0.5, streaming)
            for i in range(num_calls)
        ]
        assert streaming.wait(timeout=30)
        pause(0.7, worker)
        outcomes = [call.result() for call in calls]
    assert any(num_chunks > 0 for num_chunks, _ in outcomes), outcomes  # tokens were streaming
    assert [code for _, code in outcomes] == [grpc.StatusCode.DEADLINE_EXCEEDED] * num_calls
    wait_all_blocks_free(worker.target)


def test_a_stream_envoy_cut_for_idleness_is_reopened_by_the_sdk(
    router: ServerProcess, pki: Pki, tmp_path: Path
) -> None:
    """The SDK's one Generate stream may sit idle past Envoy's stream_idle_timeout (an hour
    as shipped, a second here); the next request opens a new stream and gets its tokens."""
    config = envoy_config(_free_port(), router.port, _free_port(), pki.ca.cert)
    _connection_manager(config)["stream_idle_timeout"] = "1s"

    async def twice_with_a_pause(target: str) -> tuple[list[int], list[int]]:
        async with AsyncClient(target) as client:
            first = await client.generate([51, 52, 53], GREEDY)
            await asyncio.sleep(2.0)
            second = await client.generate([51, 52, 53], GREEDY)
        return first.token_ids, second.token_ids

    with _run_envoy(config, tmp_path) as envoy:
        first, second = asyncio.run(twice_with_a_pause(envoy.target))
        assert envoy.stat("http.headrace.downstream_rq_idle_timeout") >= 1  # it was cut
    assert first == second and len(first) == GREEDY.max_tokens
