"""One client stream on the router: its requests from admission to their last chunk.

Like the worker's session: requests are admitted (or refused in-band), a request reusing the
id of one in flight is refused in the response's `duplicates` without touching that one, and
closing the stream abandons whatever still runs. The session is its outbox's flow-control
hooks: when a client stops reading and responses pile up, its requests are paused on their
workers (a `Pause` on the worker stream, so the worker stops generating for them rather
than the router buffering without bound), and a request held past the slow-reader timeout
fails with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.router.request import RoutedRequest
from headrace.sdk import auth, status
from headrace.sdk.errors import HeadraceError, InvalidArgumentError, ResourceExhaustedError
from headrace.sdk.streams import FlowLimits, ResponseQueue

if TYPE_CHECKING:
    from headrace.router.router import Router


@dataclass(slots=True)
class RouterSession:
    """The requests of one client stream (one `Generate` RPC, or one `GenerateOne`)."""

    router: Router
    flow: FlowLimits
    #: The call's metadata (W3C trace context for requests that carry none).
    metadata: Sequence[tuple[str, str | bytes]]
    requests: dict[str, RoutedRequest] = field(default_factory=dict)
    #: Refusals of requests that reused an id in flight, sent with the next response.
    duplicates: list[pb.DuplicateRequest] = field(default_factory=list)
    #: Requests the client paused itself.
    paused_by_client: set[str] = field(default_factory=set)
    #: A timer per held request: it fails the request when the slow-reader timeout passes.
    hold_timers: dict[str, asyncio.TimerHandle] = field(default_factory=dict)
    input_done: bool = False
    fault: HeadraceError | None = None
    outbox: ResponseQueue[list[pb.Chunk]] = field(init=False)
    #: The call's API key, when it has per-request limits (see `headrace.sdk.auth`).
    caller: auth.Caller | None = field(init=False)

    def __post_init__(self) -> None:
        self.outbox = ResponseQueue(self.flow, self)
        self.caller = auth.current_caller()

    def submit(self, wire_request: pb.Request) -> None:
        request_id = wire_request.request_id
        if request_id in self.requests:
            error = InvalidArgumentError(
                "request_id", f"{request_id!r} is already in flight on this stream"
            )
            self.duplicates.append(
                pb.DuplicateRequest(request_id=request_id, error=status.to_wire(error))
            )
            self.wake()
            return
        try:
            request = self._admit(wire_request)
        except HeadraceError as error:
            self.router.metrics.rejected(status.status_code(error).name)
            self.outbox.put([status.error_chunk(request_id, error)])
            return
        self.requests[request.client_id] = request
        if self.outbox.holding:
            self._hold(request)

    def _admit(self, wire_request: pb.Request) -> RoutedRequest:
        """The caller's key, then the router, admit the request (or raise the refusal)."""
        if self.caller is None:
            return self.router.admit(wire_request, self.outbox, self.metadata)
        refusal = self.caller.admit(wire_request)
        if refusal is not None:
            raise refusal
        try:
            return self.router.admit(wire_request, self.outbox, self.metadata)
        except HeadraceError:
            self.caller.done()
            raise

    def cancel(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self.router.cancel(request)

    def wake(self) -> None:
        self.outbox.put([])

    # --- flow control -------------------------------------------------------------------

    def pause(self, request_ids: list[str]) -> None:
        for request in self._known(request_ids):
            self.paused_by_client.add(request.client_id)
            self._hold(request)

    def resume(self, request_ids: list[str]) -> None:
        for request in self._known(request_ids):
            self.paused_by_client.discard(request.client_id)
            if not self.outbox.holding:
                self._release(request)

    def hold_all(self) -> None:
        for request in self.requests.values():
            self._hold(request)

    def release_all(self) -> None:
        for request in self.requests.values():
            if request.client_id not in self.paused_by_client:
                self._release(request)

    def _known(self, request_ids: list[str]) -> list[RoutedRequest]:
        return [self.requests[i] for i in request_ids if i in self.requests]

    def _hold(self, request: RoutedRequest) -> None:
        if request.client_id in self.hold_timers:
            return
        self.router.hold(request, True)
        timeout_s = self.flow.slow_reader_timeout_s
        error = ResourceExhaustedError(
            f"the client read none of this request's output for {timeout_s:g} s"
        )
        self.hold_timers[request.client_id] = asyncio.get_running_loop().call_later(
            timeout_s, self.router.fail, request, error
        )

    def _release(self, request: RoutedRequest) -> None:
        timer = self.hold_timers.pop(request.client_id, None)
        if timer is not None:
            timer.cancel()
            self.router.hold(request, False)

    # --- responses ----------------------------------------------------------------------

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        async for chunks in self.chunk_lists():
            response = pb.GenerateResponse(chunks=chunks, duplicates=self.duplicates)
            self.duplicates = []
            if response.chunks or response.duplicates:
                yield response

    async def chunk_lists(self) -> AsyncIterator[list[pb.Chunk]]:
        """What the router sent this session, one list per worker step (empty: a wake-up),
        until the session is done; a request is forgotten as its last chunk passes."""
        while not self._is_done():
            chunks = await self.outbox.get()
            for chunk in chunks:
                if chunk.finished:
                    self._forget(chunk.request_id)
            yield chunks

    def _is_done(self) -> bool:
        if self.fault is not None:
            return True
        idle = not self.requests and not self.duplicates and self.outbox.empty()
        return self.input_done and idle

    def _forget(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None and self.caller is not None:
            self.caller.done()
        self.paused_by_client.discard(request_id)
        timer = self.hold_timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        for request in self.requests.values():
            self.router.abandon(request)
            if self.caller is not None:
                self.caller.done()
        for timer in self.hold_timers.values():
            timer.cancel()
        self.requests.clear()
        self.hold_timers.clear()
