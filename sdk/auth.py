"""Who may call what: the API-key check at the door of every headrace server.

Design note. Authentication and authorisation live here alone, in one
`grpc.aio.ServerInterceptor` that a server installs when it has API keys
(`ServerSecurity.interceptors`). For each call:

1. `grpc.health.v1.Health` is open: Kubernetes' probes and load balancers send no metadata.
2. The ``authorization: Bearer KEY`` metadata must carry a known key, else UNAUTHENTICATED.
3. The method must be one for callers (`CALLER_METHODS`, reflection); every other method
   (`WorkerControl.Drain` today; the pause, weight and sleep calls when they come) needs an
   ``admin`` key, else PERMISSION_DENIED. A new method is admin-only until it is listed here.
4. A key with a priority ceiling or a concurrency limit has its `Generate` / `GenerateOne`
   requests checked one by one (`KeyLimits`): a priority above the ceiling is refused with
   PERMISSION_DENIED (never clamped: a caller is never served at a priority it did not ask
   for); one request over max_concurrency gets RESOURCE_EXHAUSTED with RetryInfo. On
   `GenerateOne` that is the RPC's status; on a multiplexed `Generate` stream it is the
   refused request's own last chunk, in-band, and the stream's other requests carry on. A
   request counts from admission until its finished chunk goes out or its call ends.
   The interceptor only names the caller (`current_caller`, set for the handler); the
   stream sessions, which admit and finish requests anyway, ask it per request.

Keys without limits (the router's key at its workers, admin keys) pass straight to the
handler, so checking them costs one digest per call. Refusals are logged with the key's name
and the peer, never the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import worker_pb2
from headrace.sdk import status
from headrace.sdk.api_keys import ApiKey, ApiKeys
from headrace.sdk.credentials import bearer_token
from headrace.sdk.errors import (
    HeadraceError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)

logger = logging.getLogger(__name__)

_GENERATION = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_CONTROL = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name
GENERATE = f"/{_GENERATION}/Generate"
GENERATE_ONE = f"/{_GENERATION}/GenerateOne"
#: Methods any known key may call. Everything else, and any method added later, needs admin.
CALLER_METHODS = frozenset(
    {
        GENERATE,
        GENERATE_ONE,
        f"/{_GENERATION}/GetModelInfo",
        f"/{_GENERATION}/Tokenize",
        f"/{_GENERATION}/Detokenize",
        f"/{_CONTROL}/WatchLoad",
    }
)
#: Services whose every method any known key may call (describing the API reveals nothing).
CALLER_SERVICES = frozenset(
    {"grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)
#: Services open without a key.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})
#: What RESOURCE_EXHAUSTED for a key over its max_concurrency tells the client to wait.
RETRY_AFTER_S = 1.0

Behavior = Callable[..., Any]


def _service(method: str) -> str:
    """ "/pkg.Service/Method" → "pkg.Service"."""
    return method.lstrip("/").partition("/")[0]


def _for_callers(method: str) -> bool:
    """Whether any known key may call ``method`` (else it needs an admin key)."""
    return method in CALLER_METHODS or _service(method) in CALLER_SERVICES


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every call but health's needs a known key; control calls need an admin one."""

    def __init__(self, keys: ApiKeys, retry_after_s: float = RETRY_AFTER_S) -> None:
        self.keys = keys
        self.limits = KeyLimits(retry_after_s)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or _service(method) in OPEN_SERVICES:
            return handler
        try:
            key = self.authorize(method, details.invocation_metadata)
        except HeadraceError as error:
            return _same_kind(handler, _refusal(method, "", error))
        if key.has_limits and method in (GENERATE, GENERATE_ONE):
            behavior = handler.stream_stream if method == GENERATE else handler.unary_stream
            return _same_kind(handler, _with_caller(behavior, self.limits, key, method))
        return handler

    def authorize(self, method: str, metadata: Any) -> ApiKey:
        """The caller's key, if it may call ``method``; else the error that refuses it."""
        token = bearer_token(metadata)
        if token is None:
            raise UnauthenticatedError("an API key is required: authorization: Bearer KEY")
        key = self.keys.find(token)
        if key is None:
            raise UnauthenticatedError("the API key is not known to this server")
        if not key.admin and not _for_callers(method):
            raise PermissionDeniedError(f"{method} needs an admin API key; {key.name!r} is not")
        return key


#: How long a refused request stream may take to deliver its first message.
FIRST_MESSAGE_WAIT_S = 2.0


def _refusal(method: str, key_name: str, error: HeadraceError) -> Behavior:
    """A handler body that ends the call with ``error``.

    On a request stream it first reads the client's first message: an asyncio client whose
    write is still in flight when the status arrives reports INTERNAL "Internal error from
    Core" instead of the status (grpc/grpc#36066), so the refusal would reach it garbled."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        _log_refusal(method, key_name, context, error)
        if isinstance(request, AsyncIterator):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(FIRST_MESSAGE_WAIT_S):
                    await anext(request, None)
        await status.abort(context, error)

    return refuse


def _log_refusal(
    method: str, key_name: str, context: grpc.aio.ServicerContext, error: HeadraceError
) -> None:
    who = f"key {key_name!r} at {context.peer()}" if key_name else context.peer()
    logger.info("refused %s from %s: %s: %s", method, who, error.grpc_code, error)


def _same_kind(handler: grpc.RpcMethodHandler, behavior: Behavior) -> grpc.RpcMethodHandler:
    """A handler for ``behavior`` with the streaming kind and codecs of ``handler``."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class KeyLimits:
    """Requests in flight per key, over all calls; each request checked against its key."""

    def __init__(self, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        #: Key name → its requests admitted and not finished.
        self.in_flight: Counter[str] = Counter()

    def check(self, key: ApiKey, request: pb.Request) -> HeadraceError | None:
        """The error that refuses ``request`` for ``key``, or None to admit it."""
        if key.max_priority is not None and request.priority > key.max_priority:
            return PermissionDeniedError(
                f"priority {request.priority} is above the ceiling of API key {key.name!r} "
                f"({key.max_priority})"
            )
        num_in_flight = self.in_flight[key.name]
        if key.max_concurrency is not None and num_in_flight >= key.max_concurrency:
            return ResourceExhaustedError(
                f"API key {key.name!r} already has {num_in_flight} requests in flight "
                "(its max_concurrency)",
                retry_after_s=self.retry_after_s,
            )
        return None

    def acquire(self, key: ApiKey) -> None:
        self.in_flight[key.name] += 1

    def release(self, key: ApiKey) -> None:
        self.in_flight[key.name] -= 1
        if self.in_flight[key.name] <= 0:
            del self.in_flight[key.name]


@dataclass(frozen=True, slots=True)
class Caller:
    """The key of the call being served, with its per-request limits."""

    key: ApiKey
    limits: KeyLimits
    method: str
    peer: str

    def admit(self, request: pb.Request) -> HeadraceError | None:
        """Count ``request`` against the key (call `done` when it ends), or the error that
        refuses it (logged here, by the key's name)."""
        error = self.limits.check(self.key, request)
        if error is not None:
            logger.info(
                "refused %s from key %r at %s: %s: %s",
                self.method,
                self.key.name,
                self.peer,
                error.grpc_code,
                error,
            )
            return error
        self.limits.acquire(self.key)
        return None

    def done(self) -> None:
        """A request `admit` let in has finished (or its call ended)."""
        self.limits.release(self.key)


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "headrace_caller", default=None
)


def current_caller() -> Caller | None:
    """The limited key of the call this handler serves; None when its key has no limits
    (or the server has no keys)."""
    return _CALLER.get()


def _with_caller(behavior: Behavior, limits: KeyLimits, key: ApiKey, method: str) -> Behavior:
    """``behavior`` (a coroutine, or an async generator of responses) with `current_caller`
    naming ``key`` inside it."""

    def name_caller(context: grpc.aio.ServicerContext) -> None:
        _CALLER.set(Caller(key, limits, method, context.peer()))

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            name_caller(context)
            async for response in behavior(request, context):
                yield response

        return stream

    async def named(request: Any, context: grpc.aio.ServicerContext) -> Any:
        name_caller(context)
        return await behavior(request, context)

    return named
