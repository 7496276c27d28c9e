"""API keys at the door of a server (`sdk/auth.py`), against an in-process server whose
`Generation` streams scripted tokens: who gets in, which calls need admin, and each key's
priority ceiling and concurrency, on both `Generate` (in-band) and `GenerateOne` (status)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from headrace.protos import control_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from headrace.protos import generation_pb2 as pb
from headrace.sdk import AsyncClient, GenerationConfig, auth, status, wire
from headrace.sdk.api_keys import ApiKeys
from headrace.sdk.credentials import API_KEY_ENV, bearer_metadata
from headrace.sdk.errors import (
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from headrace.sdk.security import ServerSecurity
from headrace.sdk.serving import GENERATION_SERVICE, Server

ADMIN = "admin-key-0123456789abcdef"
CALLER = "caller-key-0123456789abcdef"
LIMITED = "limited-key-0123456789abcdef"
KEYS = ApiKeys.parse(
    f"{ADMIN} name=ops admin\n{CALLER} name=caller\n"
    f"{LIMITED} name=limited max_priority=5 max_concurrency=2\n"
)
CONTROL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name


class _Scripted(generation_pb2_grpc.GenerationServicer):
    """Each request streams ``max_tokens`` one-token chunks, 10 ms apart, then finishes.
    Requests are admitted through the call's `auth.current_caller()`, as the router's and
    the worker's stream sessions admit them."""

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        out: asyncio.Queue[pb.Chunk | None] = asyncio.Queue()
        caller = auth.current_caller()
        runs: list[asyncio.Task[None]] = []

        async def read() -> None:
            async for message in request_iterator:
                if message.WhichOneof("kind") == "request":
                    runs.append(asyncio.create_task(_admitted(caller, message.request, out)))
            await asyncio.gather(*runs)
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (chunk := await out.get()) is not None:
                yield pb.GenerateResponse(chunks=[chunk])
        finally:
            reader.cancel()
            for run in runs:
                run.cancel()

    async def GenerateOne(
        self, request: pb.Request, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        caller = auth.current_caller()
        refusal = caller.admit(request) if caller is not None else None
        if refusal is not None:
            await status.abort(context, refusal)
        chunks: list[pb.Chunk] = []
        try:
            await _run(request, chunks.append)
        finally:
            if caller is not None:
                caller.done()
        for chunk in chunks:
            yield pb.GenerateResponse(chunks=[chunk])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return pb.ModelInfo(name="scripted")


async def _admitted(
    caller: auth.Caller | None, request: pb.Request, out: asyncio.Queue[pb.Chunk | None]
) -> None:
    """Run one request of a stream if the caller's key admits it, else refuse it in-band."""
    refusal = caller.admit(request) if caller is not None else None
    if refusal is not None:
        out.put_nowait(status.error_chunk(request.request_id, refusal))
        return
    try:
        await _run(request, out.put_nowait)
    finally:
        if caller is not None:
            caller.done()


async def _run(request: pb.Request, emit: Callable[[pb.Chunk], object]) -> None:
    num_tokens = request.config.max_tokens or 1
    for i in range(num_tokens):
        await asyncio.sleep(0.01)
        done = i == num_tokens - 1
        emit(pb.Chunk(request_id=request.request_id, token_ids=[i], finished=done))


class _Control(worker_pb2_grpc.WorkerControlServicer):
    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.LoadReport]:
        yield worker_pb2.LoadReport(free_kv_blocks=3)

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        return worker_pb2.DrainResponse(remaining_requests=7)


async def _serve() -> tuple[Server, str]:
    server = Server([GENERATION_SERVICE, CONTROL_SERVICE], 16, ServerSecurity(api_keys=KEYS))
    generation_pb2_grpc.add_GenerationServicer_to_server(_Scripted(), server.server)
    worker_pb2_grpc.add_WorkerControlServicer_to_server(_Control(), server.server)
    port = await server.start("127.0.0.1", 0)
    await server.set_serving(True)
    return server, f"127.0.0.1:{port}"


def _with_server(test: Callable[[str, grpc.aio.Channel], Awaitable[None]]) -> None:
    async def run() -> None:
        server, target = await _serve()
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                await test(target, channel)
        finally:
            await server.stop(None)

    asyncio.run(run())


def _request(request_id: str, max_tokens: int = 3, priority: int = 0) -> pb.Request:
    config = GenerationConfig(max_tokens=max_tokens)
    return wire.request_to_wire(request_id, "x", config, priority=priority)


async def _code(call: Awaitable[object]) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code()


async def _stream(
    channel: grpc.aio.Channel, key: str, requests: list[pb.Request]
) -> list[pb.Chunk]:
    """Send ``requests`` on one Generate stream, half-close, and collect every chunk."""
    stub = generation_pb2_grpc.GenerationStub(channel)
    messages = [pb.GenerateRequest(request=request) for request in requests]
    call = stub.Generate(iter(messages), metadata=bearer_metadata(key), timeout=10)
    return [chunk async for response in call for chunk in response.chunks]


def test_missing_or_unknown_key_is_unauthenticated_on_every_call() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for metadata in (
            (),
            bearer_metadata("not-a-key-0123456789abc"),
            (("authorization", CALLER),),
        ):
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=5)
            assert await _code(info) == grpc.StatusCode.UNAUTHENTICATED
            one = stub.GenerateOne(_request("1"), metadata=metadata, timeout=5)
            assert await _code(_drain(one)) == grpc.StatusCode.UNAUTHENTICATED
            stream = stub.Generate(iter([]), metadata=metadata, timeout=5)
            assert await _code(_drain(stream)) == grpc.StatusCode.UNAUTHENTICATED
        info = await stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=bearer_metadata(CALLER), timeout=5
        )
        assert info.name == "scripted"
        async with AsyncClient(target, api_key="") as client:  # the SDK's typed error
            with pytest.raises(UnauthenticatedError):
                await client.generate("x")

    _with_server(test)


async def _drain(call: AsyncIterator[object]) -> None:
    async for _ in call:
        pass


def test_health_needs_no_key() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING

    _with_server(test)


def test_reflection_takes_any_known_key() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        refused = stub.ServerReflectionInfo(iter([ask]), timeout=5)
        assert await _code(_drain(refused)) == grpc.StatusCode.UNAUTHENTICATED
        call = stub.ServerReflectionInfo(iter([ask]), metadata=bearer_metadata(CALLER), timeout=5)
        names = {s.name for r in [r async for r in call] for s in r.list_services_response.service}
        assert GENERATION_SERVICE in names

    _with_server(test)


def test_drain_needs_an_admin_key_and_load_reports_do_not() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        control = worker_pb2_grpc.WorkerControlStub(channel)
        drain = control.Drain(worker_pb2.DrainRequest(), metadata=bearer_metadata(CALLER))
        assert await _code(drain) == grpc.StatusCode.PERMISSION_DENIED
        done = await control.Drain(worker_pb2.DrainRequest(), metadata=bearer_metadata(ADMIN))
        assert done.remaining_requests == 7
        reports = control.WatchLoad(worker_pb2.WatchLoadRequest(), metadata=bearer_metadata(CALLER))
        assert (await reports.read()).free_kv_blocks == 3
        reports.cancel()

    _with_server(test)


def test_priority_above_the_ceiling_is_refused_in_band_and_the_stream_carries_on() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        requests = [_request("high", priority=6), _request("ceiling", priority=5)]
        chunks = await _stream(channel, LIMITED, requests)
        (refused,) = [c for c in chunks if c.request_id == "high"]
        assert refused.finished and refused.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        assert "above the ceiling of API key 'limited' (5)" in refused.error.message
        assert [t for c in chunks if c.request_id == "ceiling" for t in c.token_ids] == [0, 1, 2]
        # Other keys have no ceiling.
        assert len(await _stream(channel, CALLER, [_request("high", priority=99)])) == 3

    _with_server(test)


def test_priority_above_the_ceiling_is_the_status_of_generate_one() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        async with AsyncClient(target, api_key=LIMITED) as client:
            with pytest.raises(PermissionDeniedError, match="above the ceiling"):
                await client.generate("x", priority=9)
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateOne(_request("1", priority=9), metadata=bearer_metadata(LIMITED))
        assert await _code(_drain(call)) == grpc.StatusCode.PERMISSION_DENIED

    _with_server(test)


def test_a_key_over_its_concurrency_gets_resource_exhausted_with_retry_info() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Two long requests hold the key's two slots; the third on the stream is refused.
        long = [_request("a", 30), _request("b", 30), _request("c", 30)]
        held = asyncio.create_task(_stream(channel, LIMITED, long))
        await asyncio.sleep(0.1)
        one = stub.GenerateOne(_request("d"), metadata=bearer_metadata(LIMITED), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _drain(one)
        error = status.from_rpc_error(caught.value)  # across calls: the RPC's status
        assert isinstance(error, ResourceExhaustedError) and error.retry_after_s == 1.0
        chunks = await held
        (refused,) = [c for c in chunks if c.request_id == "c"]
        assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert refused.error.retry_delay.ToNanoseconds() == 10**9
        assert sum(len(c.token_ids) for c in chunks) == 60  # a and b ran to the end
        # Finished requests gave their slots back.
        assert len(await _stream(channel, LIMITED, [_request("e", 1), _request("f", 1)])) == 2

    _with_server(test)


def _open(channel: grpc.aio.Channel, key: str) -> tuple[asyncio.Queue[pb.Request], Any]:
    """A Generate stream left open: put requests on the queue, read the call."""
    outgoing: asyncio.Queue[pb.Request] = asyncio.Queue()

    async def messages() -> AsyncIterator[pb.GenerateRequest]:
        while True:
            yield pb.GenerateRequest(request=await outgoing.get())

    stub = generation_pb2_grpc.GenerationStub(channel)
    return outgoing, stub.Generate(messages(), metadata=bearer_metadata(key), timeout=10)


async def _until_finished(call: Any, request_ids: set[str]) -> list[pb.Chunk]:
    chunks: list[pb.Chunk] = []
    while request_ids - {c.request_id for c in chunks if c.finished}:
        chunks.extend((await call.read()).chunks)
    return chunks


def test_finished_requests_give_their_slots_back_on_the_same_stream() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        outgoing, call = _open(channel, LIMITED)
        for round_number in range(3):  # 2 slots, 6 requests, never more than 2 at once
            ids = {f"{round_number}a", f"{round_number}b"}
            for request_id in sorted(ids):
                outgoing.put_nowait(_request(request_id, 2))
            chunks = await _until_finished(call, ids)
            assert not [c for c in chunks if c.HasField("error")], round_number
        call.cancel()

    _with_server(test)


def test_a_closed_stream_gives_its_requests_slots_back() -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        outgoing, call = _open(channel, LIMITED)
        outgoing.put_nowait(_request("a", 1000))
        outgoing.put_nowait(_request("b", 1000))
        await call.read()
        call.cancel()
        await asyncio.sleep(0.1)
        chunks = await _stream(channel, LIMITED, [_request("c", 2), _request("d", 2)])
        assert not [c for c in chunks if c.HasField("error")]
        assert len(chunks) == 4

    _with_server(test)


def test_the_sdk_sends_headrace_api_key_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def test(target: str, channel: grpc.aio.Channel) -> None:
        monkeypatch.setenv(API_KEY_ENV, CALLER)
        async with AsyncClient(target) as client:
            assert (await client.generate("x", GenerationConfig(max_tokens=2))).token_ids == [0, 1]
            assert (await client.model_info()).name == "scripted"
        async with AsyncClient(target, api_key="") as client:  # "" sends none
            with pytest.raises(UnauthenticatedError):
                await client.model_info()
        monkeypatch.delenv(API_KEY_ENV)
        async with AsyncClient(target) as client:
            with pytest.raises(UnauthenticatedError):
                await client.generate("x")

    _with_server(test)


def test_every_generation_control_call_is_admin_only() -> None:
    """Pause, weight updates, sleep, LoRA adapters: none is listed for callers, so each needs
    an admin key (the worker's and the router's `GenerationControl` alike)."""
    service = control_pb2.DESCRIPTOR.services_by_name["GenerationControl"]
    methods = [f"/{service.full_name}/{method.name}" for method in service.methods]
    assert len(methods) == 13
    assert not [method for method in methods if auth._for_callers(method)]


def test_every_generation_call_takes_any_known_key() -> None:
    """The `Generation` service is the callers' (Tokenize and Detokenize too): a caller key
    counting tokens is not asked for an admin key."""
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    methods = [f"/{service.full_name}/{method.name}" for method in service.methods]
    assert {"Tokenize", "Detokenize"} <= {method.name for method in service.methods}
    interceptor = auth.ApiKeyInterceptor(KEYS)
    for method in methods:
        assert interceptor.authorize(method, bearer_metadata(CALLER)).name == "caller"
