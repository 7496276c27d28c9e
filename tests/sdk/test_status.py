"""Status codes map to the SDK's typed exceptions: one case per mapping, both for errors that
travel in-band on a request's last chunk and for errors that end the whole RPC.

A small in-process gRPC server stands in for a worker: the request's prompt names the status
code it answers with.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import status
from headrace.sdk.client import AsyncClient
from headrace.sdk.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    HeadraceError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    error_for_code,
)

MAPPING: dict[grpc.StatusCode, type[HeadraceError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: HeadraceError,  # no class of its own
}


class _Failing(generation_pb2_grpc.GenerationServicer):
    """In-band: every request fails with the code its prompt names. Stream-level: a request
    whose prompt starts with "rpc:" ends the whole RPC with that code instead."""

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for message in request_iterator:
            request = message.request
            rpc_level, _, name = request.text.rpartition(":")
            code = grpc.StatusCode[name]
            if rpc_level:
                retry_after_s = 1.5 if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                message = f"config.top_p: whole stream fails with {name}"
                field = "config.top_p" if code == grpc.StatusCode.INVALID_ARGUMENT else ""
                await status.abort(
                    context, error_for_code(name, message, field, retry_after_s=retry_after_s)
                )
            error = pb.Error(code=code.value[0], message=f"config.top_p: fails with {name}")
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                error.field = "config.top_p"
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                error.retry_delay.FromMilliseconds(1500)
            chunk = pb.Chunk(request_id=request.request_id, finished=True, error=error)
            yield pb.GenerateResponse(chunks=[chunk])


async def _raised(prompt: str) -> HeadraceError:
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(_Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(HeadraceError) as caught:
                await client.generate(prompt)
            return caught.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize("code", list(MAPPING), ids=lambda code: code.name)
@pytest.mark.parametrize("level", ["in_band", "rpc"])
def test_status_code_maps_to_exception(code: grpc.StatusCode, level: str) -> None:
    prompt = code.name if level == "in_band" else f"rpc:{code.name}"
    error = asyncio.run(_raised(prompt))
    assert type(error) is MAPPING[code]
    assert error.grpc_code == code.name
    assert "fails with" in str(error)
    if isinstance(error, InvalidArgumentError):
        assert error.field == "config.top_p"
        assert str(error).startswith("config.top_p: ")
        assert str(error).count("config.top_p") == 1
    if isinstance(error, ResourceExhaustedError):  # RetryInfo (rpc) or Error.retry_delay
        assert error.retry_after_s == pytest.approx(1.5)


@pytest.mark.parametrize("error_class", sorted(set(MAPPING.values()), key=lambda c: c.__name__))
def test_wire_round_trip_keeps_the_type(error_class: type[HeadraceError]) -> None:
    if error_class is InvalidArgumentError:
        error: HeadraceError = InvalidArgumentError("config.n", "must be >= 1")
    elif error_class is ResourceExhaustedError:
        error = ResourceExhaustedError("queue full", retry_after_s=2.0)
    else:
        error = error_class("something")
    back = status.from_wire(status.to_wire(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "field", None) == getattr(error, "field", None)
    assert getattr(back, "retry_after_s", None) == getattr(error, "retry_after_s", None)
