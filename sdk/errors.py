"""Typed errors shared by the SDK, the router and the worker.

Each class names the gRPC status code it travels as (by name, so this module needs no grpc
import); the servers map exceptions to codes in one place and the SDK maps codes back.
"""

from __future__ import annotations


class HeadraceError(Exception):
    """Base of every error headrace raises on purpose."""

    grpc_code = "UNKNOWN"


class InvalidArgumentError(HeadraceError, ValueError):
    """The caller sent a bad value; ``field`` names it (e.g. ``config.top_p``)."""

    grpc_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NotFoundError(HeadraceError):
    """A named thing (model, request id) does not exist."""

    grpc_code = "NOT_FOUND"


class ResourceExhaustedError(HeadraceError):
    """The server is overloaded; retry after ``retry_after_s`` seconds."""

    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnavailableError(HeadraceError):
    """The server is shutting down, or no worker can take the request; retry after
    ``retry_after_s`` seconds where the server says."""

    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceededError(HeadraceError):
    """The request's timeout passed before it finished."""

    grpc_code = "DEADLINE_EXCEEDED"


class CancelledError(HeadraceError):
    """The request was cancelled by its client."""

    grpc_code = "CANCELLED"


class UnauthenticatedError(HeadraceError):
    """The call carried no API key, or one the server does not know."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(HeadraceError):
    """The caller's API key may not do this (a control call without `admin`, a priority
    above the key's ceiling)."""

    grpc_code = "PERMISSION_DENIED"


class FailedPreconditionError(HeadraceError):
    """The call does not fit the server's state (e.g. updating from a weights group no worker
    joined); the message says what to do first."""

    grpc_code = "FAILED_PRECONDITION"


class InternalError(HeadraceError):
    """A bug or a fault inside headrace; the message says what failed."""

    grpc_code = "INTERNAL"


_BY_CODE: dict[str, type[HeadraceError]] = {
    cls.grpc_code: cls
    for cls in (
        NotFoundError,
        DeadlineExceededError,
        CancelledError,
        UnauthenticatedError,
        PermissionDeniedError,
        FailedPreconditionError,
        InternalError,
    )
}


def error_for_code(
    code: str, message: str, field: str = "", retry_after_s: float | None = None
) -> HeadraceError:
    """The typed error for a status code name ("INVALID_ARGUMENT", ...) and its message.

    A code without a class of its own gives a plain `HeadraceError` whose ``grpc_code`` is
    that name, so nothing is lost.
    """
    if code == InvalidArgumentError.grpc_code:
        prefix = f"{field}: "
        return InvalidArgumentError(field, message.removeprefix(prefix) if field else message)
    if code == ResourceExhaustedError.grpc_code:
        return ResourceExhaustedError(message, retry_after_s)
    if code == UnavailableError.grpc_code:
        return UnavailableError(message, retry_after_s)
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls(message)
    error = HeadraceError(message)
    error.grpc_code = code
    return error
