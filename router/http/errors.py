"""headrace's typed errors as OpenAI-shaped HTTP answers, in one place.

Every refusal of the HTTP door, whether the door's own (a bad field, a body too large), the
router's (a full queue, no worker) or a worker's (an unknown model, a prompt too long),
arrives here as a `HeadraceError` and leaves as
``{"error": {"message", "type", "param", "code"}}`` with the status its gRPC code maps to
(the same table `sdk/status.py` keeps for gRPC). Overload and unavailability carry a
``Retry-After`` header when the server knows how long to wait.

Nothing raised while serving reaches the ASGI server: uvicorn answers an exception that
escapes before the response starts with a plain-text 500, and one that escapes after it by
closing the connection, so a client's next request on that keep-alive connection would fail
too. Handlers turn errors into answers themselves; `ErrorGuard`, around the whole app, is the
last line (a bug: a 500 in OpenAI's shape, or the end of a response already started).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from headrace.sdk.errors import HeadraceError, InternalError, InvalidArgumentError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class BodyTooLargeError(InvalidArgumentError):
    """The request body is over the door's limit (HTTP 413)."""


class RouteNotFoundError(HeadraceError):
    """No such path (HTTP 404, not a model's NOT_FOUND)."""

    grpc_code = "NOT_FOUND"


class MethodNotAllowedError(HeadraceError):
    """The path exists, the method does not (HTTP 405)."""

    grpc_code = "UNIMPLEMENTED"


@dataclass(frozen=True, slots=True)
class HttpError:
    """What one `HeadraceError` becomes on the wire."""

    status: int
    #: OpenAI's error ``type``.
    type: str
    #: OpenAI's error ``code``.
    code: str


#: gRPC status name → the HTTP answer. Anything unlisted is a 500.
BY_GRPC_CODE: dict[str, HttpError] = {
    "INVALID_ARGUMENT": HttpError(400, "invalid_request_error", "invalid_argument"),
    "NOT_FOUND": HttpError(404, "invalid_request_error", "model_not_found"),
    "UNAUTHENTICATED": HttpError(401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": HttpError(403, "permission_error", "permission_denied"),
    "RESOURCE_EXHAUSTED": HttpError(429, "rate_limit_error", "rate_limit_exceeded"),
    "UNAVAILABLE": HttpError(503, "service_unavailable_error", "unavailable"),
    "DEADLINE_EXCEEDED": HttpError(504, "timeout_error", "deadline_exceeded"),
    "CANCELLED": HttpError(499, "invalid_request_error", "cancelled"),
    "UNIMPLEMENTED": HttpError(405, "invalid_request_error", "method_not_allowed"),
}
INTERNAL = HttpError(500, "server_error", "internal_error")


def http_error(error: HeadraceError) -> HttpError:
    if isinstance(error, BodyTooLargeError):
        return HttpError(413, "invalid_request_error", "request_too_large")
    if isinstance(error, RouteNotFoundError):
        return HttpError(404, "invalid_request_error", "not_found")
    return BY_GRPC_CODE.get(error.grpc_code, INTERNAL)


def error_body(error: HeadraceError, param: str | None = None) -> dict[str, object]:
    """``{"error": {...}}`` for ``error``; ``param`` is the OpenAI field it names, if any."""
    answer = http_error(error)
    message = str(error)
    if param is None and isinstance(error, InvalidArgumentError) and error.field:
        param = error.field
    if param is None and answer.code == "model_not_found":
        param = "model"  # the only thing a completion call names that may not exist
    return {"error": {"message": message, "type": answer.type, "param": param, "code": answer.code}}


def retry_after(error: HeadraceError) -> dict[str, str]:
    """The ``Retry-After`` header (whole seconds, at least 1) when the error says when."""
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is None:
        return {}
    return {"retry-after": str(max(1, math.ceil(retry_after_s)))}


def as_headrace_error(error: BaseException) -> HeadraceError:
    """A typed error for anything raised while serving; untyped ones are bugs (logged)."""
    if isinstance(error, HeadraceError):
        return error
    logger.error("unexpected error in the HTTP door", exc_info=error)
    return InternalError(f"internal error: {type(error).__name__}")


class ErrorGuard:
    """ASGI middleware: whatever the app raises is logged and answered here, never raised on
    to the server (which would drop the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        progress = _ResponseProgress(send)
        try:
            await self.app(scope, receive, progress.send)
        except Exception as exc:
            await progress.finish(exc)


class _ResponseProgress:
    """How far a response got, so a failure can be answered without breaking the protocol."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True
        await self._send(message)

    async def finish(self, exc: Exception) -> None:
        """Answer a failure: a 500 if nothing was sent, else end the response begun (a
        Starlette handler may have answered already: then there is nothing left to do)."""
        if self.complete:
            logger.debug("error after the response was sent", exc_info=exc)
            return
        try:
            if not self.started:
                error = as_headrace_error(exc)
                body: dict[str, Any] = error_body(error)
                headers = [(b"content-type", b"application/json")]
                await self._send({"type": "http.response.start", "status": 500, "headers": headers})
                await self._send({"type": "http.response.body", "body": json.dumps(body).encode()})
            else:
                logger.error("unexpected error in the HTTP door mid-response", exc_info=exc)
                await self._send({"type": "http.response.body", "body": b""})
        except OSError:
            pass  # the client is gone: nothing to answer
