"""One HTTP completion call through the router, as an ASGI response.

Design note. A call is a `RouterSession`, the very object a gRPC stream uses: its requests
(one per prompt) go through `Router.admit`, the priority queue, dispatch, failover, the
per-key limits and the flow control of a slow reader exactly as gRPC ones do. Two tasks
run: the responder reads the session's responses and writes them out, and a watcher waits
for the client to go away (`http.disconnect`). Whichever ends first ends the call; leaving
closes the session, which abandons whatever still runs, so a client that disconnects frees
its KV blocks within one engine step, whether its request was queued, prefilling or
decoding.

The response starts only with the session's first chunks: an error there (a refusal at
admission, an unknown model or a prompt a worker cannot take) is still an HTTP status. A
plain response waits for every request to finish. A stream is Server-Sent Events, each
``data: <json>\\n\\n``, ending with ``data: [DONE]\\n\\n``; an error after it started is one
``data: {"error": ...}`` event before the end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from headrace.protos import generation_pb2 as pb
from headrace.router.http import errors
from headrace.router.http.requests import ApiRequest
from headrace.router.http.responses import ResponseBuilder, encode, sse
from headrace.router.session import RouterSession
from headrace.sdk import status
from headrace.sdk.errors import HeadraceError

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Proxies that buffer (nginx) would hold the events back.
    (b"x-accel-buffering", b"no"),
]
DONE = b"data: [DONE]\n\n"
#: The status a call that ended by the client's leaving is counted under (nginx's).
CLIENT_CLOSED = 499


async def send_json(send: Send, status_code: int, body: object, headers: dict[str, str]) -> None:
    extra = [(k.encode(), v.encode()) for k, v in headers.items()]
    await send(
        {"type": "http.response.start", "status": status_code, "headers": JSON_HEADERS + extra}
    )
    await send({"type": "http.response.body", "body": encode(body)})


class CallLog(Protocol):
    """Where a call's HTTP status and end are recorded (its span and metrics)."""

    def status(self, code: int) -> None: ...

    def end(self) -> None: ...


class HttpCall:
    """The ASGI response of one completion call."""

    def __init__(
        self, request: ApiRequest, session: RouterSession, builder: ResponseBuilder, log: CallLog
    ) -> None:
        self.request = request
        self.session = session
        self.builder = builder
        self.log = log

    async def __call__(self, scope: object, receive: Receive, send: Send) -> None:
        responder = asyncio.ensure_future(self._respond(send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            done, _ = await asyncio.wait({responder, watcher}, return_when="FIRST_COMPLETED")
            if responder in done:
                responder.result()
            else:
                self.log.status(CLIENT_CLOSED)
        finally:
            for task in (responder, watcher):
                task.cancel()
            await asyncio.gather(responder, return_exceptions=True)
            self.session.close()
            self.log.end()

    async def _respond(self, send: Send) -> None:
        responses = self.session.chunk_lists()
        chunks = await _first_chunks(responses)
        error = _error(chunks)
        if error is not None:
            await self._send_error(send, error)
        elif self.request.stream:
            await self._stream(send, chunks, responses)
        else:
            await self._whole(send, chunks, responses)

    async def _send_error(self, send: Send, error: HeadraceError) -> None:
        answer = errors.http_error(error)
        self.log.status(answer.status)
        body = errors.error_body(error, self._param(error))
        await send_json(send, answer.status, body, errors.retry_after(error))

    def _param(self, error: HeadraceError) -> str | None:
        field = getattr(error, "field", "")
        return self.request.param(field) if field else None

    async def _whole(
        self, send: Send, chunks: list[pb.Chunk], responses: AsyncIterator[list[pb.Chunk]]
    ) -> None:
        builder = self.builder
        while True:
            for chunk in chunks:
                if chunk.HasField("error"):
                    await self._send_error(send, status.from_wire(chunk.error))
                    return
                builder.add(chunk)
            next_chunks = await anext(responses, None)
            if next_chunks is None:
                break
            chunks = next_chunks
        self.log.status(200)
        await send_json(send, 200, builder.body(), {})

    async def _stream(
        self, send: Send, chunks: list[pb.Chunk], responses: AsyncIterator[list[pb.Chunk]]
    ) -> None:
        self.log.status(200)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self.builder.note_prompts(chunks)  # the opening events' usage, if they carry it
        data, error = self._events(chunks, self.builder.first_events())
        while True:
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            if error is not None:
                break
            next_chunks = await anext(responses, None)
            if next_chunks is None:
                break
            data, error = self._events(next_chunks, b"")
        if error is None and self.request.include_usage:
            usage = self.builder.usage_event()
            await send({"type": "http.response.body", "body": usage, "more_body": True})
        await send({"type": "http.response.body", "body": DONE})

    def _events(self, chunks: list[pb.Chunk], data: bytes) -> tuple[bytes, HeadraceError | None]:
        """``data`` and the SSE events of one response's chunks, and the error that ends
        the stream, if one does (its event is the last)."""
        events = [data]
        for chunk in chunks:
            if chunk.HasField("error"):
                error = status.from_wire(chunk.error)
                events.append(sse(errors.error_body(error, self._param(error))))
                return b"".join(events), error
            events.append(self.builder.events(chunk))
        return b"".join(events), None


async def _first_chunks(responses: AsyncIterator[list[pb.Chunk]]) -> list[pb.Chunk]:
    """The first chunks the session sends (empty lists are wake-ups, not answers), or none
    if it ends without any: the response's status waits for them."""
    async for chunks in responses:
        if chunks:
            return chunks
    return []


def _error(chunks: list[pb.Chunk]) -> HeadraceError | None:
    for chunk in chunks:
        if chunk.HasField("error"):
            return status.from_wire(chunk.error)
    return None


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
