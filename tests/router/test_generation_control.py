"""The router's streamed weight update against a scripted in-process worker: every upload to a
worker ends (its last chunk and its end reach the worker) or fails with a status, in time.

When the worker reads is what these tests vary; the router forwards the client's stream to it
as the chunks arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
import torch
from headrace.protos import control_pb2 as cpb
from headrace.protos import control_pb2_grpc
from headrace.router import generation_control
from headrace.router.generation_control import RouterControlService
from headrace.sdk import AsyncClient
from headrace.sdk.client import CHANNEL_OPTIONS
from headrace.sdk.errors import DeadlineExceededError
from headrace.sdk.serving import add_service, channel_options
from headrace.sdk.weights import DEFAULT_CHUNK_BYTES, ControlReport, tensor_chunks

CONTROL = cpb.DESCRIPTOR.services_by_name["GenerationControl"]
#: The SDK's chunk size: gRPC buffers less than one such chunk for a call whose server has
#: not read yet, so the router's write of the first one waits for the worker.
CHUNK_BYTES = DEFAULT_CHUNK_BYTES
#: One chunk in that write and two behind it: the router has all of them, and the client's
#: end, before the worker reads the first.
NUM_CHUNKS = 3


class _Worker(control_pb2_grpc.GenerationControlServicer):
    """Stages an upload, starting to read it ``read_delay_s`` after the call came; commits
    what it staged."""

    def __init__(self, read_delay_s: float) -> None:
        self.read_delay_s = read_delay_s
        #: (name, offset) of each chunk of the last upload it staged.
        self.staged: list[tuple[str, int]] = []
        #: Uploads in progress (until their call ends: finished, cancelled or past deadline).
        self.num_open = 0
        self.version = "default"

    def _state(self) -> cpb.ControlResponse:
        return cpb.ControlResponse(workers=[cpb.WorkerState(weight_version=self.version)])

    async def UpdateWeightsFromTensors(
        self, request_iterator: AsyncIterator[cpb.WeightsChunk], context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        self.num_open += 1
        try:
            await asyncio.sleep(self.read_delay_s)
            chunks = [(chunk.name, chunk.offset) async for chunk in request_iterator]
        finally:
            self.num_open -= 1
        self.staged = chunks
        return self._state()

    async def UpdateWeights(
        self, request: cpb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        assert request.staged
        self.version = request.version
        return self._state()

    async def DropStagedWeights(
        self, request: cpb.DropStagedWeightsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ControlResponse:
        self.staged = []
        return self._state()


@dataclass
class _Link:
    """What the router's control service asks of a worker link."""

    target: str
    generation_control: control_pb2_grpc.GenerationControlStub
    metadata: tuple[tuple[str, str], ...] = ()
    healthy: bool = True
    report: None = None

    def note_state(self, state: cpb.WorkerState) -> None:
        pass


@dataclass
class _Pool:
    links: dict[str, _Link] = field(default_factory=dict)


@dataclass
class _Router:
    """What the router's control service asks of the router: its one worker's link."""

    pool: _Pool = field(default_factory=_Pool)

    def on_change(self) -> None:
        pass


async def _serve(servicer: object) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=channel_options(16))  # the servers' default limits
    add_service(servicer, server, CONTROL)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(NUM_CHUNKS * CHUNK_BYTES // 4)}  # float32: NUM_CHUNKS chunks


async def _through_a_router(worker: _Worker, upload: Any) -> ControlReport | Exception:
    """``await upload(router_target)`` with a router in front of ``worker``: what it returned
    or raised. Then, before the servers stop, the worker's uploads have ended."""
    worker_server, worker_target = await _serve(worker)
    channel = grpc.aio.insecure_channel(worker_target, options=CHANNEL_OPTIONS)
    router = _Router()
    stub = control_pb2_grpc.GenerationControlStub(channel)
    router.pool.links[worker_target] = _Link(worker_target, stub)
    router_server, router_target = await _serve(RouterControlService(router))  # type: ignore[arg-type]
    try:
        result: ControlReport | Exception = await asyncio.wait_for(upload(router_target), 60)
    except Exception as error:
        result = error
    try:
        for _ in range(500):
            if worker.num_open == 0:
                break
            await asyncio.sleep(0.01)
        assert worker.num_open == 0, "the router left an upload to the worker open"
    finally:
        await router_server.stop(None)
        await worker_server.stop(None)
        await channel.close()
    return result


def _sdk_upload(timeout: float) -> Any:
    async def upload(target: str) -> ControlReport:
        async with AsyncClient(target) as client:
            tensors = _tensors()
            return await client.update_weights_from_tensors(tensors.items(), "v1", timeout=timeout)

    return upload


def test_issue_30_a_streamed_update_through_a_router_ends_on_a_worker_that_reads_late() -> None:
    """Issue 30: the README's `update_weights_from_tensors` through a router hung forever
    after the update from disk. The router dropped the end of its upload to the worker when
    the chunks it forwarded had not been read yet (its queue full), so the worker waited for
    more chunks, the router for the worker and the client for the router."""
    worker = _Worker(read_delay_s=0.5)
    answer = asyncio.run(_through_a_router(worker, _sdk_upload(timeout=10)))
    assert isinstance(answer, ControlReport), answer
    assert answer.weight_version == "v1"
    assert worker.staged == [("w", i * CHUNK_BYTES) for i in range(NUM_CHUNKS)]


def test_an_upload_to_a_worker_that_stalls_fails_at_the_clients_deadline() -> None:
    worker = _Worker(read_delay_s=3600)
    answer = asyncio.run(_through_a_router(worker, _sdk_upload(timeout=1)))
    assert isinstance(answer, DeadlineExceededError), answer
    assert worker.version == "default"  # nothing committed


def test_a_client_that_sets_no_deadline_and_stalls_gets_the_routers_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gRPC client of another language may set no deadline and never end its upload: the
    router's own deadline (`upload_timeout` of an uncounted upload) ends it, and its
    forward to the worker."""
    monkeypatch.setattr(generation_control, "upload_timeout", lambda num_bytes: 0.5)

    async def stalled_upload(target: str) -> ControlReport:
        async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            call = control_pb2_grpc.GenerationControlStub(channel).UpdateWeightsFromTensors()
            await call.write(next(tensor_chunks(_tensors().items(), "v1")))
            return ControlReport.from_wire(await call)  # no more chunks, no end

    worker = _Worker(read_delay_s=0)
    answer = asyncio.run(_through_a_router(worker, stalled_upload))
    assert isinstance(answer, grpc.RpcError), answer
    assert answer.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not end within 0.5 s" in str(answer.details())
    assert worker.version == "default"  # nothing committed
