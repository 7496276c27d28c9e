"""One client stream on the router: its requests from admission to their last chunk.

Like the worker's session: requests are admitted (or refused in-band), a request reusing the
id of one in flight is refused in the response's `duplicates` without touching that one, and
closing the stream abandons whatever still runs. Its `FlowControl` (see
`headrace.sdk.streams`) holds requests when the client stops reading and responses pile up,
or when the client says `Pause`: a held request is held on its worker (a `Pause` on the
worker stream, so the worker stops generating for it rather than the router buffering
without bound), and one held past the slow-reader timeout fails with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.router.request import RoutedRequest
from headrace.sdk import auth, status
from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.sdk.streams import FlowControl, FlowLimits, ResponseQueue, SessionBase

if TYPE_CHECKING:
    from headrace.router.router import Router


@dataclass(slots=True)
class RouterSession(SessionBase):
    """The requests of one client stream (one `Generate` RPC, or one `GenerateOne`)."""

    router: Router
    limits: FlowLimits
    #: The call's metadata (W3C trace context for requests that carry none).
    metadata: Sequence[tuple[str, str | bytes]]
    requests: dict[str, RoutedRequest] = field(default_factory=dict)
    #: Refusals of requests that reused an id in flight, sent with the next response.
    duplicates: list[pb.DuplicateRequest] = field(default_factory=list)
    #: The call's API key, when it has per-request limits (see `headrace.sdk.auth`): the
    #: gRPC call's own by default; the HTTP door passes the one its request carried.
    caller: auth.Caller | None = field(default_factory=auth.current_caller)
    input_done: bool = False
    fault: HeadraceError | None = None
    flow: FlowControl = field(init=False)
    outbox: ResponseQueue[list[pb.Chunk]] = field(init=False)

    def __post_init__(self) -> None:
        self.flow = FlowControl(self.limits, self._hold, self._release, self._expire)
        self.outbox = ResponseQueue(self.limits, self.flow)

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
        self.flow.add(request.client_id)

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

    # --- flow control (the session's side of its FlowControl) ---------------------------

    def _hold(self, request_id: str) -> None:
        self.router.hold(self.requests[request_id])

    def _release(self, request_id: str) -> None:
        self.router.release(self.requests[request_id])

    def _expire(self, request_id: str, error: HeadraceError) -> None:
        self.router.fail(self.requests[request_id], error)

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
        self.flow.remove(request_id)

    def close(self) -> None:
        for request in self.requests.values():
            self.router.abandon(request)
            if self.caller is not None:
                self.caller.done()
        self.flow.close()
        self.requests.clear()
