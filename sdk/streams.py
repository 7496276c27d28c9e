"""How a server (router or worker) runs one `Generate` or `GenerateOne` call.

A call is a `StreamSession`: `serve_stream` reads the client's messages into it (requests,
cancels, flow control) while sending its responses; `serve_one` does the same for one
request. A message that cannot be decoded is a fault of the whole stream: it ends with
INVALID_ARGUMENT, logged once at WARNING, and nothing else on the stream is affected before
that. Leaving the call for any reason closes the session, which stops its requests.

Flow control (design note). A client that stops reading must not make the server buffer
without bound or keep generating for it. Each session sends through a `ResponseQueue`: once
`FlowLimits.max_backlog` responses wait unsent, the queue asks the session's `FlowControl`
to hold the stream's requests (no tokens generated for them; the worker's KV blocks may be
preempted), and to release them when the backlog is down to half. A request held for longer
than `FlowLimits.slow_reader_timeout_s` is ended with RESOURCE_EXHAUSTED. Clients may also
hold and release requests themselves with the `Pause` and `Resume` messages (the router
does, for its own slow clients); a request the client holds stays held through a backlog's
release. One `FlowControl` serves router and worker sessions alike: each says how to hold,
release and fail one of its requests (on its worker link, or in its engine).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc.aio
from grpc._cython import cygrpc
from headrace.protos import generation_pb2 as pb
from headrace.sdk import status, wire
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    InvalidArgumentError,
    ResourceExhaustedError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request deserializer returns for bytes that are not its message."""

    message_type: str
    error: str

    def fault(self) -> InvalidArgumentError:
        return InvalidArgumentError("", f"could not decode a {self.message_type}: {self.error}")


@dataclass(frozen=True, slots=True)
class FlowLimits:
    #: Unsent responses one stream may queue before its requests are held.
    max_backlog: int = 64
    #: How long a held request waits for its reader before it fails RESOURCE_EXHAUSTED.
    slow_reader_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_backlog < 2:
            raise InvalidArgumentError("max_backlog", f"must be >= 2, got {self.max_backlog}")
        if self.slow_reader_timeout_s <= 0:
            raise InvalidArgumentError("slow_reader_timeout_s", "must be > 0")


class StreamSession(Protocol):
    """The requests of one `Generate` (or `GenerateOne`) call, as a server tracks them."""

    #: No more client messages will come (half-closed, or GenerateOne): see `end_input`.
    input_done: bool
    #: Why the stream itself must fail (an undecodable message), else None: see `fail`.
    fault: HeadraceError | None

    def end_input(self) -> None:
        """No more client messages will come."""

    def fail(self, fault: HeadraceError) -> None:
        """The stream itself fails with ``fault`` once its responses are out."""

    def submit(self, request: pb.Request) -> None:
        """Admit a request, or answer it in-band with the error that refuses it."""

    def cancel(self, request_id: str) -> None:
        """The client's Cancel; unknown ids are ignored."""

    def hold(self, request_ids: list[str]) -> None:
        """The client's `Pause`: hold these requests; unknown ids are ignored."""

    def release(self, request_ids: list[str]) -> None:
        """The client's `Resume`: release these requests; unknown ids are ignored."""

    def wake(self) -> None:
        """Make `responses` look at the session's state again."""

    def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """The messages to send, until input is done and every request has finished (or the
        session has a fault)."""

    def close(self) -> None:
        """The call is over: stop what still runs and route nothing more."""


class FlowHooks(Protocol):
    """What a `ResponseQueue` asks of its session's flow control."""

    def hold_all(self) -> None:
        """The backlog is too long: hold every request of the stream."""

    def release_all(self) -> None:
        """The reader caught up: let the stream's requests go on."""


class ResponseQueue(Generic[T]):
    """A stream's unsent responses, with the flow control of the design note (none without
    limits and hooks). Used on the event loop only."""

    def __init__(self, limits: FlowLimits | None = None, hooks: FlowHooks | None = None) -> None:
        #: Past this many unsent items the hooks hold the stream; None: never.
        self._max_backlog = limits.max_backlog if limits is not None and hooks else None
        self._hooks = hooks
        self._queue: asyncio.Queue[T] = asyncio.Queue()
        #: The hooks were told to hold the stream, and not yet to release it.
        self.holding = False

    def __len__(self) -> int:
        return self._queue.qsize()

    def put(self, item: T) -> None:
        self._queue.put_nowait(item)
        if self._hooks and self._max_backlog and not self.holding and len(self) > self._max_backlog:
            self.holding = True
            self._hooks.hold_all()

    async def get(self) -> T:
        item = await self._queue.get()
        if (
            self._hooks
            and self._max_backlog
            and self.holding
            and len(self) <= self._max_backlog // 2
        ):
            self.holding = False
            self._hooks.release_all()
        return item

    def empty(self) -> bool:
        return self._queue.empty()


class FlowControl:
    """Which requests of one stream are held, and why (see the design note); its
    `ResponseQueue`'s hooks. Used on the event loop only.

    The session supplies what differs between router and worker, each called with the
    client's request id: ``hold`` and ``release`` one request (on its worker link, or in its
    engine), and ``expire`` it with the slow reader's error. It tells the flow control which
    requests the stream has: `add` each one admitted, `remove` each one finished.
    """

    def __init__(
        self,
        limits: FlowLimits,
        hold: Callable[[str], object],
        release: Callable[[str], object],
        expire: Callable[[str, ResourceExhaustedError], object],
    ) -> None:
        self._slow_reader_timeout_s = limits.slow_reader_timeout_s
        self._hold, self._release, self._expire = hold, release, expire
        #: The stream's requests (admitted and not finished), in admission order.
        self._request_ids: dict[str, None] = {}
        #: The held requests, each with the timer that expires it at the slow-reader timeout.
        self._timers: dict[str, asyncio.TimerHandle] = {}
        #: Requests the client held (`Pause`): a backlog's release leaves them held.
        self._held_by_client: set[str] = set()
        #: The queue's backlog is too long (`hold_all`, not yet `release_all`).
        self._backlogged = False

    def add(self, request_id: str) -> None:
        """A request admitted; held at once if the client is behind already."""
        self._request_ids[request_id] = None
        if self._backlogged:
            self._hold_one(request_id)

    def remove(self, request_id: str) -> None:
        """A request finished (nothing to release)."""
        self._request_ids.pop(request_id, None)
        self._held_by_client.discard(request_id)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """The stream is gone: no timer fires any more."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._request_ids.clear()
        self._held_by_client.clear()

    # --- the client's Pause and Resume ------------------------------------------------------

    def hold_for_client(self, request_ids: list[str]) -> None:
        for request_id in self._known(request_ids):
            self._held_by_client.add(request_id)
            self._hold_one(request_id)

    def release_for_client(self, request_ids: list[str]) -> None:
        """Released unless the backlog still holds the stream."""
        for request_id in self._known(request_ids):
            self._held_by_client.discard(request_id)
            if not self._backlogged:
                self._release_one(request_id)

    def _known(self, request_ids: list[str]) -> list[str]:
        return [request_id for request_id in request_ids if request_id in self._request_ids]

    # --- the backlog (FlowHooks) ------------------------------------------------------------

    def hold_all(self) -> None:
        self._backlogged = True
        for request_id in list(self._request_ids):
            self._hold_one(request_id)

    def release_all(self) -> None:
        self._backlogged = False
        for request_id in list(self._request_ids):
            if request_id not in self._held_by_client:
                self._release_one(request_id)

    # --- one request --------------------------------------------------------------------

    def _hold_one(self, request_id: str) -> None:
        if request_id in self._timers:
            return
        self._hold(request_id)
        timeout_s = self._slow_reader_timeout_s
        error = ResourceExhaustedError(
            f"the client read none of this request's output for {timeout_s:g} s"
        )
        self._timers[request_id] = asyncio.get_running_loop().call_later(
            timeout_s, self._expire, request_id, error
        )

    def _release_one(self, request_id: str) -> None:
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            self._release(request_id)


def start_timeout(
    timeout_s: float | None, expire: Callable[[DeadlineExceededError], object]
) -> asyncio.TimerHandle | None:
    """A request's own timeout: ``expire(DeadlineExceededError)`` after timeout_s seconds on
    the running loop (None: no timeout). Cancel the handle when the request ends first."""
    if timeout_s is None:
        return None
    error = DeadlineExceededError(f"timeout of {timeout_s:g} s passed")
    return asyncio.get_running_loop().call_later(timeout_s, expire, error)


class SessionBase:
    """What every server's `StreamSession` does alike: end its input, fail its stream, and
    pass the client's own holds to its `FlowControl`. A session adds its requests and how
    it wakes its `responses`."""

    input_done: bool
    fault: HeadraceError | None
    flow: FlowControl

    def end_input(self) -> None:
        self.input_done = True
        self.wake()

    def fail(self, fault: HeadraceError) -> None:
        self.fault = fault
        self.wake()

    def hold(self, request_ids: list[str]) -> None:
        self.flow.hold_for_client(request_ids)

    def release(self, request_ids: list[str]) -> None:
        self.flow.release_for_client(request_ids)

    def wake(self) -> None:
        raise NotImplementedError


async def serve_stream(
    session: StreamSession,
    messages: AsyncIterator[pb.GenerateRequest | Undecodable],
    context: grpc.aio.ServicerContext,
) -> None:
    """`Generate`: read client messages into the session while sending its responses.

    Leaving for any reason (the client cancelled, disconnected, or the server stops) closes
    the session, which stops its requests.
    """
    reader = asyncio.create_task(_read(session, messages))
    try:
        async for response in session.responses():
            if not await _send(context, response):
                return
        if session.fault is not None:
            await status.abort(context, session.fault)
    finally:
        reader.cancel()
        session.close()


async def _send(context: grpc.aio.ServicerContext, response: pb.GenerateResponse) -> bool:
    """Write one response; False once the client is gone. Handlers write with
    ``context.write`` (not by yielding) so a client that cancels with responses still unsent
    ends the call quietly instead of failing gRPC's write with a logged traceback."""
    if context.cancelled() or context.done():
        return False
    try:
        await context.write(response)
    except (asyncio.InvalidStateError, grpc.aio.UsageError, cygrpc.BaseError):
        return False  # it went away between the check and the write
    return True


async def _read(
    session: StreamSession, messages: AsyncIterator[pb.GenerateRequest | Undecodable]
) -> None:
    try:
        async for message in messages:
            if isinstance(message, Undecodable):
                logger.warning("ending a Generate stream: %s", message.fault())
                session.fail(message.fault())
                return
            _apply(session, message)
    finally:
        session.end_input()


def _apply(session: StreamSession, message: pb.GenerateRequest) -> None:
    kind = message.WhichOneof("kind")
    if kind == "request":
        session.submit(message.request)
    elif kind == "cancel":
        session.cancel(message.cancel.request_id)
    elif kind == "pause":
        session.hold(list(message.pause.request_ids))
    elif kind == "resume":
        session.release(list(message.resume.request_ids))


async def serve_one(
    session: StreamSession, request: pb.Request | Undecodable, context: grpc.aio.ServicerContext
) -> None:
    """`GenerateOne`: one request, bounded by the RPC's deadline; an in-band error ends the
    RPC with its status instead."""
    if isinstance(request, Undecodable):
        logger.warning("refusing a GenerateOne call: %s", request.fault())
        await status.abort(context, request.fault())
    session.end_input()
    try:
        request = wire.with_request_id(request)
        session.submit(_bound_by_deadline(request, context.time_remaining()))
        async for response in session.responses():
            failed = [chunk for chunk in response.chunks if chunk.HasField("error")]
            if failed:
                await status.abort(context, status.from_wire(failed[0].error))
            if not await _send(context, response):
                return
    finally:
        session.close()


def _bound_by_deadline(request: pb.Request, time_remaining_s: float | None) -> pb.Request:
    """`GenerateOne`: the request with its timeout cut to the RPC's deadline, if sooner."""
    if time_remaining_s is None:
        return request
    if request.HasField("timeout") and request.timeout.ToNanoseconds() / 1e9 <= time_remaining_s:
        return request
    bounded = pb.Request()
    bounded.CopyFrom(request)
    bounded.timeout.CopyFrom(status.duration(max(time_remaining_s, 1e-3)))
    return bounded
