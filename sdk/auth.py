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

Keys without limits (the router's key at its workers, admin keys) pass straight to the
handler, so checking them costs one digest per call. Refusals are logged with the key's name
and the peer, never the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
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
    {GENERATE, GENERATE_ONE, f"/{_GENERATION}/GetModelInfo", f"/{_CONTROL}/WatchLoad"}
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
            return self.limits.wrap(handler, key)
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


def _refusal(method: str, key_name: str, error: HeadraceError) -> Behavior:
    """A handler body that ends the call with ``error``."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        _log_refusal(method, key_name, context, error)
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

    def acquire(self, key: ApiKey, num_requests: int = 1) -> None:
        self.in_flight[key.name] += num_requests

    def release(self, key: ApiKey, num_requests: int = 1) -> None:
        self.in_flight[key.name] -= num_requests
        if self.in_flight[key.name] <= 0:
            del self.in_flight[key.name]

    def wrap(self, handler: grpc.RpcMethodHandler, key: ApiKey) -> grpc.RpcMethodHandler:
        """`Generate` / `GenerateOne` with every request checked against ``key``."""
        if handler.request_streaming:
            return _same_kind(handler, self._limit_stream(handler.stream_stream, key))
        return _same_kind(handler, self._limit_one(handler.unary_stream, key))

    def _limit_one(self, behavior: Behavior, key: ApiKey) -> Behavior:
        async def limited(
            request: pb.Request, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[pb.GenerateResponse]:
            error = self.check(key, request)
            if error is not None:
                await _refusal(GENERATE_ONE, key.name, error)(request, context)
            self.acquire(key)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                self.release(key)

        return limited

    def _limit_stream(self, behavior: Behavior, key: ApiKey) -> Behavior:
        async def limited(
            requests: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[pb.GenerateResponse]:
            stream = _LimitedStream(self, key, context)
            async for response in stream.serve(behavior, requests):
                yield response

        return limited


class _LimitedStream:
    """One `Generate` call of a limited key: the handler's responses, with the refusals of
    requests that never reached it merged in (one queue, filled by a pump task)."""

    def __init__(self, limits: KeyLimits, key: ApiKey, context: grpc.aio.ServicerContext) -> None:
        self.limits = limits
        self.key = key
        self.context = context
        #: Request id → how many requests with it are admitted and not finished (a repeated
        #: id is the handler's to refuse, with a finished chunk of its own).
        self.live: Counter[str] = Counter()
        self.out: asyncio.Queue[pb.GenerateResponse | None] = asyncio.Queue()

    async def serve(
        self, behavior: Behavior, requests: AsyncIterator[pb.GenerateRequest]
    ) -> AsyncIterator[pb.GenerateResponse]:
        pump = asyncio.create_task(self._pump(behavior(self._admitted(requests), self.context)))
        try:
            while (response := await self.out.get()) is not None:
                yield response
            await pump  # the handler's own failure ends the call
        finally:
            pump.cancel()
            self.limits.release(self.key, sum(self.live.values()))
            self.live.clear()

    async def _admitted(
        self, requests: AsyncIterator[pb.GenerateRequest]
    ) -> AsyncIterator[pb.GenerateRequest]:
        async for message in requests:
            if message.WhichOneof("kind") == "request":
                request = message.request
                error = self.limits.check(self.key, request)
                if error is not None:
                    _log_refusal(GENERATE, self.key.name, self.context, error)
                    chunk = status.error_chunk(request.request_id, error)
                    self.out.put_nowait(pb.GenerateResponse(chunks=[chunk]))
                    continue
                self.live[request.request_id] += 1
                self.limits.acquire(self.key)
            yield message

    async def _pump(self, responses: AsyncIterator[pb.GenerateResponse]) -> None:
        try:
            async for response in responses:
                self._release_finished(response)
                self.out.put_nowait(response)
        finally:
            self.out.put_nowait(None)

    def _release_finished(self, response: pb.GenerateResponse) -> None:
        for chunk in response.chunks:
            if chunk.finished and self.live[chunk.request_id] > 0:
                self.live[chunk.request_id] -= 1
                self.limits.release(self.key)
