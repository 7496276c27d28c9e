"""Typed errors ↔ gRPC status codes, in one place for the SDK, the router and the worker.

An error that belongs to one request travels in-band as a `headrace.v1.Error` on its last
chunk (`to_wire` / `from_wire`); an error that ends a whole RPC travels as the RPC's status
(`abort` on the server, `from_rpc_error` in the client).
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from headrace.protos import generation_pb2 as pb
from headrace.sdk.errors import (
    HeadraceError,
    InternalError,
    InvalidArgumentError,
    error_for_code,
)

logger = logging.getLogger(__name__)

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(error: HeadraceError) -> grpc.StatusCode:
    return grpc.StatusCode.__members__.get(error.grpc_code, grpc.StatusCode.UNKNOWN)


def to_wire(error: HeadraceError) -> pb.Error:
    wire = pb.Error(code=status_code(error).value[0], message=str(error))
    if isinstance(error, InvalidArgumentError):
        wire.field = error.field
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is not None:
        wire.retry_delay.CopyFrom(duration(retry_after_s))
    return wire


def error_chunk(request_id: str, error: HeadraceError) -> pb.Chunk:
    """The last chunk of a request that failed with ``error``."""
    return pb.Chunk(
        request_id=request_id,
        finish_reason=pb.FINISH_REASON_ERROR,
        finished=True,
        error=to_wire(error),
    )


def from_wire(wire: pb.Error) -> HeadraceError:
    code = _BY_NUMBER.get(wire.code, grpc.StatusCode.UNKNOWN)
    retry_after_s = (
        wire.retry_delay.ToTimedelta().total_seconds() if wire.HasField("retry_delay") else None
    )
    return error_for_code(code.name, wire.message, wire.field, retry_after_s)


def from_rpc_error(error: grpc.RpcError) -> HeadraceError:
    """The typed error for a failed RPC (a `grpc.RpcError` that is also a `grpc.Call`)."""
    code: grpc.StatusCode = error.code()
    details: str = error.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, rest = details.partition(": ")
        return error_for_code(code.name, details, field if rest else "")
    return error_for_code(code.name, details, retry_after_s=_retry_after_s(error))


#: Trailing metadata key of the rich status (`google.rpc.Status`), as gRPC defines it.
STATUS_DETAILS_KEY = "grpc-status-details-bin"


def _retry_after_s(error: grpc.RpcError) -> float | None:
    """The `google.rpc.RetryInfo` delay in a failed RPC's status details, if any."""
    for key, value in error.trailing_metadata() or ():
        if key != STATUS_DETAILS_KEY:
            continue
        rich = status_pb2.Status.FromString(value)
        for detail in rich.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.ToNanoseconds() / 1e9
    return None


async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the RPC with the status that ``error`` maps to (INTERNAL for anything untyped)."""
    if not isinstance(error, HeadraceError):
        logger.exception("unexpected error in an RPC handler", exc_info=error)
        error = InternalError(f"internal error: {type(error).__name__}: {error}")
    code = status_code(error)
    retry_after_s = getattr(error, "retry_after_s", None)
    trailing: tuple[tuple[str, bytes], ...] = ()
    if retry_after_s is not None:
        # Overload: say when to come back, as google.rpc.RetryInfo in the rich status.
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration(retry_after_s)))
        rich = status_pb2.Status(code=code.value[0], message=str(error), details=[detail])
        trailing = ((STATUS_DETAILS_KEY, rich.SerializeToString()),)
    await context.abort(code, str(error), trailing)
    raise AssertionError("ServicerContext.abort always raises")


def duration(seconds: float) -> duration_pb2.Duration:
    wire = duration_pb2.Duration()
    wire.FromNanoseconds(round(seconds * 1e9))
    return wire
