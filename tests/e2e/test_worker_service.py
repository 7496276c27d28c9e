"""The worker as a service: bad input answered in-band per request, health, reflection,
message-size limits, drain on SIGTERM."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from headrace.sdk import wire
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import UnavailableError

from tests.e2e.processes import ServerProcess, start_worker, wait_all_blocks_free


def _request(request_id: str, **config: object) -> pb.Request:
    """A valid request whose config fields are then overwritten raw (bypassing the SDK)."""
    request = wire.request_to_wire(request_id, "hello there", GenerationConfig(max_tokens=4))
    for name, value in config.items():
        if isinstance(value, list):
            getattr(request.config, name).extend(value)
        else:
            setattr(request.config, name, value)
    return request


def _no_prompt() -> pb.Request:
    request = _request("no-prompt")
    request.ClearField("text")
    return request


def _with(request: pb.Request, **fields: object) -> pb.Request:
    for name, value in fields.items():
        if name == "token_ids":
            request.token_ids.ids.extend(value)  # type: ignore[arg-type]
        elif name == "timeout_s":
            request.timeout.FromNanoseconds(int(value * 1e9))  # type: ignore[operator]
        else:
            setattr(request, name, value)
    return request


#: (request, expected status code, field named in the error). Each is a distinct mistake.
BAD_REQUESTS = {
    "top_p": (_request("top-p", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "config.top_p"),
    "max_tokens": (
        _request("mt", max_tokens=0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "config.max_tokens",
    ),
    "temperature": (
        _request("temp", temperature=-1.0),
        grpc.StatusCode.INVALID_ARGUMENT,
        "config.temperature",
    ),
    "min_tokens": (
        _request("min", min_tokens=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "config.min_tokens",
    ),
    "n": (_request("n", n=0), grpc.StatusCode.INVALID_ARGUMENT, "config.n"),
    "logprobs": (_request("lp", logprobs=50), grpc.StatusCode.INVALID_ARGUMENT, "config.logprobs"),
    "seed": (_request("seed", seed=-1), grpc.StatusCode.INVALID_ARGUMENT, "config.seed"),
    "stop": (_request("stop", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "config.stop"),
    "stop_token_ids": (
        _request("sti", stop_token_ids=[10**9]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "config.stop_token_ids",
    ),
    "request_id": (
        _with(_request("x"), request_id=""),
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id",
    ),
    "no_prompt": (_no_prompt(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "empty_text": (_with(_request("empty"), text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    "token_id_out_of_vocab": (
        _with(_request("oov"), token_ids=[1, 2, 10**6]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_token_ids",
    ),
    "prompt_beyond_context": (
        _with(_request("long"), token_ids=[5] * 600),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt",
    ),
    "timeout": (_with(_request("to"), timeout_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "timeout"),
    "unknown_model": (_with(_request("model"), model="gpt-17"), grpc.StatusCode.NOT_FOUND, ""),
}


def test_each_bad_request_fails_alone_and_the_stream_carries_on(worker: ServerProcess) -> None:
    """Bad requests interleaved with good ones on ONE stream: each bad one gets its own
    in-band error naming the field; every good one completes; the stream stays open."""
    good = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    messages: list[pb.GenerateRequest] = []
    for i, (request, _, _) in enumerate(BAD_REQUESTS.values()):
        messages.append(pb.GenerateRequest(request=wire.request_to_wire(f"good-{i}", "hi", good)))
        messages.append(pb.GenerateRequest(request=request))
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        chunks = [c for r in stub.Generate(iter(messages), timeout=60) for c in r.chunks]

    last = {c.request_id: c for c in chunks if c.finished}
    for name, (request, code, field) in BAD_REQUESTS.items():
        chunk = last[request.request_id]
        assert chunk.HasField("error"), name
        assert chunk.error.code == code.value[0], (name, chunk.error.message)
        assert chunk.error.field == field, (name, chunk.error.message)
        assert chunk.error.message.startswith(field or "model"), chunk.error.message
        assert chunk.finish_reason == pb.FINISH_REASON_ERROR
    for i in range(len(BAD_REQUESTS)):
        tokens = [t for c in chunks if c.request_id == f"good-{i}" for t in c.token_ids]
        assert len(tokens) == 16
        assert not last[f"good-{i}"].HasField("error")


def test_generate_one_bad_request_is_the_rpc_status(worker: ServerProcess) -> None:
    request, code, field = BAD_REQUESTS["top_p"]
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GenerateOne(request, timeout=30))
    assert caught.value.code() == code
    assert caught.value.details().startswith(f"{field}: ")


def test_generate_one_without_request_id_gets_one_from_the_server(worker: ServerProcess) -> None:
    """A request built by hand from the .proto needs no id on GenerateOne (only a multiplexed
    stream does): the server picks one and every chunk carries it."""
    request = _with(_request("x", max_tokens=5, ignore_eos=True), request_id="")
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        chunks = [c for r in stub.GenerateOne(request, timeout=30) for c in r.chunks]
        again = [c for r in stub.GenerateOne(request, timeout=30) for c in r.chunks]
    assert sum(len(c.token_ids) for c in chunks) == 5 and chunks[-1].finished
    (request_id,) = {c.request_id for c in chunks}
    (other_id,) = {c.request_id for c in again}
    assert request_id and other_id and request_id != other_id


def test_duplicate_id_on_the_worker_keeps_the_finished_contract(worker: ServerProcess) -> None:
    """Regression (hardening defect 6): the duplicate got a finished ERROR chunk under the
    id, and then the original's tokens and a second finished chunk followed it."""
    config = GenerationConfig(max_tokens=200, temperature=0.0, ignore_eos=True)
    first = pb.GenerateRequest(request=wire.request_to_wire("same", "one", config))
    messages = [first, first]
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        responses = list(stub.Generate(iter(messages), timeout=60))
    duplicates = [d for r in responses for d in r.duplicates]
    assert [(d.request_id, d.error.field) for d in duplicates] == [("same", "request_id")]
    chunks = [c for r in responses for c in r.chunks]
    assert not any(c.HasField("error") for c in chunks)
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
    assert sum(len(c.token_ids) for c in chunks) == 200  # the first one ran to the end


def test_oversized_message_is_resource_exhausted(worker: ServerProcess) -> None:
    huge = wire.request_to_wire("huge", "a" * (17 * 2**20), GenerationConfig())
    with grpc.insecure_channel(
        worker.target, options=[("grpc.max_send_message_length", 64 * 2**20)]
    ) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GenerateOne(huge, timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in caught.value.details()
    with Client(worker.target) as client:  # still serving
        assert len(client.generate("hi", GenerationConfig(max_tokens=3)).token_ids) >= 1


def test_reflection_lists_the_services(worker: ServerProcess) -> None:
    with grpc.insecure_channel(worker.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
    names = {service.name for service in response.list_services_response.service}
    assert {
        "headrace.v1.Generation",
        "headrace.v1.WorkerControl",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


def _health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(response.status)


def test_sigterm_drains_then_exits_zero(tiny_model: Path, tmp_path: Path) -> None:
    """SERVING → SIGTERM → NOT_SERVING, new work refused with UNAVAILABLE, the request in
    flight still runs to the end, exit code 0."""
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    with start_worker(tiny_model, tmp_path, "--max-num-seqs", "1") as server:
        assert _health(server.target) == serving
        assert _health(server.target, "headrace.v1.Generation") == serving
        chunks: queue.SimpleQueue[object] = queue.SimpleQueue()
        config = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)

        def stream() -> None:
            with Client(server.target) as client:
                for chunk in client.stream("a long one", config):
                    chunks.put(chunk)
            chunks.put(None)

        thread = threading.Thread(target=stream)
        thread.start()
        chunks.get(timeout=30)  # streaming has begun
        server.proc.terminate()  # SIGTERM
        deadline = time.monotonic() + 10
        while _health(server.target) != not_serving and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _health(server.target) == not_serving
        with Client(server.target) as late, pytest.raises(UnavailableError, match="draining"):
            late.generate("too late", GenerationConfig(max_tokens=2))
        thread.join(timeout=60)
        received = []
        while (item := chunks.get(timeout=5)) is not None:
            received.append(item)
        assert sum(len(c.token_ids) for c in received) >= 440  # all 450 minus the first chunk
        assert server.proc.wait(timeout=30) == 0


def test_drain_rpc_waits_for_in_flight_requests(tiny_model: Path, tmp_path: Path) -> None:
    with start_worker(tiny_model, tmp_path) as server:
        config = GenerationConfig(max_tokens=300, temperature=0.0, ignore_eos=True)
        with Client(server.target) as client:
            stream = client.stream("drain me", config)
            first = next(stream)
            with grpc.insecure_channel(server.target) as channel:
                control = worker_pb2_grpc.WorkerControlStub(channel)
                response = control.Drain(worker_pb2.DrainRequest(), timeout=60)
            rest = list(stream)
        assert response.remaining_requests == 0
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 300
        report = wait_all_blocks_free(server.target)
        assert report.draining
