"""`AsyncClient` and `Client`: talk to a headrace router or worker over gRPC.

    async with AsyncClient("localhost:50051") as client:
        result = await client.generate("The capital of France is", GenerationConfig(max_tokens=8))
        async for chunk in client.stream("Once upon a time", GenerationConfig(max_tokens=64)):
            print(chunk.text, end="", flush=True)

    # TLS with the server's CA and an API key ($HEADRACE_API_KEY when api_key is left out):
    AsyncClient("router.example:443", root_certificates=ca_pem, api_key="...")

Design note. Every call of one client shares ONE long-lived bidirectional `Generate` stream
(`_Multiplexer`): a request is a `Request` message on it and its chunks come back tagged with
its id, so a thousand concurrent calls cost one HTTP/2 stream, not a thousand. A call that is
left early (a `break` out of `stream`, a cancelled task) sends `Cancel`, which frees the
request's KV cache on the server. If the stream breaks, every call on it fails with the
stream's status and the next call opens a new one. `Client` is the blocking twin: it runs an
`AsyncClient` on an event loop thread of its own, so threads may share it.

Each call is a client span ("headrace.generate", a child of the caller's current span) whose
W3C trace context travels in `Request.trace_context`, so the router's and worker's spans of
the request join the caller's trace. Without an OpenTelemetry SDK installed, spans cost
next to nothing and are dropped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import status, tracing, wire
from headrace.sdk.config import GenerationConfig, check_int64
from headrace.sdk.control_calls import AsyncControlCalls, ControlCalls
from headrace.sdk.credentials import Metadata, bearer_metadata, default_api_key
from headrace.sdk.errors import HeadraceError, InvalidArgumentError, UnavailableError
from headrace.sdk.outputs import GenerationResult, StreamChunk
from headrace.sdk.prompts import Chat, Messages, Prompt
from opentelemetry import context as otel_context
from opentelemetry import trace

T = TypeVar("T")

#: Channel settings of the SDK; each one's reason beside it.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    # One response carries a step's chunks for every request on the stream; with logprobs
    # that outgrows the 4 MiB default well before the server's own limit.
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 16 * 2**20),
    # Ping every 30 s (the server permits 5 s) so a dead server is noticed during a long
    # prefill that sends nothing, and idle NATs keep the connection.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class _Multiplexer:
    """One `Generate` stream shared by many requests; routes chunks to their callers.

    Its own two tasks drive the call: a writer (messages queued by `open` / `close`) and a
    reader; both end when the call does, so closing a client leaves no task behind.
    """

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, metadata: Metadata) -> None:
        self._outgoing: asyncio.Queue[pb.GenerateRequest | None] = asyncio.Queue()
        self._pending: dict[str, asyncio.Queue[pb.Chunk | HeadraceError]] = {}
        self.error: HeadraceError | None = None
        self._call = stub.Generate(metadata=metadata)
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    async def _write(self) -> None:
        try:
            while (message := await self._outgoing.get()) is not None:
                await self._call.write(message)
            await self._call.done_writing()
        except (grpc.RpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the call ended: the reader reports why to every request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                for chunk in response.chunks:
                    inbox = self._pending.get(chunk.request_id)
                    if inbox is not None:
                        inbox.put_nowait(chunk)
            error: HeadraceError = UnavailableError("the server ended the stream")
        except grpc.RpcError as rpc_error:
            error = status.from_rpc_error(rpc_error)
        except asyncio.CancelledError:
            error = UnavailableError("the client was closed")
        self.error = error
        for inbox in self._pending.values():
            inbox.put_nowait(error)

    def open(self, request: pb.Request) -> asyncio.Queue[pb.Chunk | HeadraceError]:
        inbox: asyncio.Queue[pb.Chunk | HeadraceError] = asyncio.Queue()
        self._pending[request.request_id] = inbox
        self._outgoing.put_nowait(pb.GenerateRequest(request=request))
        return inbox

    def close(self, request_id: str, cancel: bool) -> None:
        self._pending.pop(request_id, None)
        if cancel and self.error is None:
            self._outgoing.put_nowait(pb.GenerateRequest(cancel=pb.Cancel(request_id=request_id)))

    def discard(self) -> None:
        """End the call; its tasks finish on their own."""
        self._outgoing.put_nowait(None)
        self._call.cancel()

    async def aclose(self) -> None:
        self.discard()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class AsyncClient(AsyncControlCalls):
    """A client of one server (router or worker); use it from one event loop. Generation
    control (pause, weight updates, sleep: admin calls) comes from `AsyncControlCalls`."""

    def __init__(
        self,
        target: str,
        *,
        model: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        options: list[tuple[str, Any]] | None = None,
        root_certificates: bytes | None = None,
        certificate_chain: bytes | None = None,
        private_key: bytes | None = None,
        api_key: str | None = None,
    ) -> None:
        """``target`` is HOST:PORT; ``model`` goes into every request (empty: the server's).

        TLS: ``root_certificates`` (PEM; None: the system's roots) and, for mTLS, the client's
        ``certificate_chain`` and ``private_key``; any of them turns TLS on (or pass ready
        ``credentials``). ``api_key`` goes with every call as ``authorization: Bearer``;
        None means $HEADRACE_API_KEY if set, "" none at all.
        """
        channel_options = CHANNEL_OPTIONS + list(options or [])
        pems = (root_certificates, certificate_chain, private_key)
        if any(pem is not None for pem in pems):
            if credentials is not None:
                raise InvalidArgumentError("credentials", "give credentials or PEMs, not both")
            credentials = grpc.ssl_channel_credentials(
                root_certificates, private_key, certificate_chain
            )
        self._metadata = bearer_metadata(default_api_key() if api_key is None else api_key or None)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_options)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self.model = model
        self._mux: _Multiplexer | None = None
        self._request_numbers = itertools.count()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.aclose()
            self._mux = None
        await self._channel.close()

    def _multiplexer(self) -> _Multiplexer:
        if self._mux is not None and self._mux.error is not None:
            self._mux.discard()  # the stream broke (a server restart): open a new one
            self._mux = None
        if self._mux is None:
            self._mux = _Multiplexer(self._stub, self._metadata)
        return self._mux

    async def stream(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> AsyncIterator[StreamChunk]:
        """Yield the request's chunks as they arrive; the last has ``finished`` set.

        ``prompt`` is text, token ids or a `Chat`; ``config`` says how to generate (None:
        `GenerationConfig`'s defaults). ``priority``: higher runs sooner (an API key with a
        ceiling refuses more with `PermissionDeniedError`); ``timeout`` (seconds) fails the
        request with `DeadlineExceededError` on the server; ``adapter`` names a loaded LoRA
        adapter (empty: the base model). Leaving the loop early cancels the request.
        A failed request raises its typed error (`InvalidArgumentError`, ...).
        """
        request = self._request(prompt, config, priority, timeout, adapter)
        # Not the current span: an async generator must not leave its context behind.
        span = tracing.tracer().start_span(
            "headrace.generate",
            kind=trace.SpanKind.CLIENT,
            attributes={tracing.REQUEST_ID: request.request_id},
        )
        request.trace_context.update(tracing.carrier(span))
        mux = self._multiplexer()
        inbox = mux.open(request)
        finished = False
        try:
            while not finished:
                item = await inbox.get()
                if isinstance(item, HeadraceError):
                    finished = True
                    raise item
                if item.HasField("error"):
                    finished = True
                    raise status.from_wire(item.error)
                chunk = wire.chunk_from_wire(item)
                finished = chunk.finished
                yield chunk
        except HeadraceError as error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            raise
        finally:
            mux.close(request.request_id, cancel=not finished)
            span.end()

    def _request(
        self,
        prompt: Prompt,
        config: GenerationConfig | None,
        priority: int,
        timeout: float | None,
        adapter: str,
    ) -> pb.Request:
        """The wire request of one call: the one place a call's keywords become fields (the
        other calls, and `Client`'s, pass theirs down to `stream`)."""
        request_id = str(next(self._request_numbers))
        config = config or GenerationConfig()
        request = wire.request_to_wire(request_id, prompt, config, priority, timeout, self.model)
        request.adapter = adapter
        return request

    async def generate(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> GenerationResult:
        """Run one request to the end; the result has every sample's tokens and text.
        Arguments as for `stream`."""
        config = config or GenerationConfig()
        result: GenerationResult | None = None
        chunks = self.stream(prompt, config, priority=priority, timeout=timeout, adapter=adapter)
        async for chunk in chunks:
            if result is None:
                result = GenerationResult.empty(
                    chunk.request_id, config.n, with_logprobs=config.logprobs is not None
                )
            result.add_chunk(chunk)
        assert result is not None  # a stream ends with a finished chunk or raises
        return result

    async def chat(
        self,
        messages: Messages,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> GenerationResult:
        """Answer a conversation (``{"role", "content"}`` dicts or `ChatMessage`s), rendered
        by the server with the model's chat template; other arguments as for `stream`."""
        prompt = Chat.of(messages)
        return await self.generate(
            prompt, config, priority=priority, timeout=timeout, adapter=adapter
        )

    def stream_chat(
        self,
        messages: Messages,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> AsyncIterator[StreamChunk]:
        """`stream` for a conversation (see `chat`)."""
        prompt = Chat.of(messages)
        return self.stream(prompt, config, priority=priority, timeout=timeout, adapter=adapter)

    async def model_info(self, timeout: float | None = 30.0) -> pb.ModelInfo:
        try:
            info: pb.ModelInfo = await self._stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as rpc_error:
            raise status.from_rpc_error(rpc_error) from None
        return info

    async def tokenize(
        self,
        prompt: str | Chat,
        *,
        add_special_tokens: bool = True,
        timeout: float | None = 30.0,
    ) -> list[int]:
        """A prompt's token ids as the server's model has them for a request with it (text
        tokenized, with the tokenizer's special tokens unless ``add_special_tokens`` is
        False; a `Chat` rendered with the chat template)."""
        request = wire.tokenize_request_to_wire(prompt, add_special_tokens, self.model)
        try:
            response: pb.TokenizeResponse = await self._stub.Tokenize(
                request, timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as rpc_error:
            raise status.from_rpc_error(rpc_error) from None
        return list(response.token_ids)

    async def detokenize(self, token_ids: list[int], *, timeout: float | None = 30.0) -> str:
        """The text of token ids, as the server's tokenizer decodes them."""
        request = pb.DetokenizeRequest(model=self.model)
        for token_id in token_ids:
            check_int64("token_ids", token_id)
        request.token_ids.extend(token_ids)
        try:
            response: pb.DetokenizeResponse = await self._stub.Detokenize(
                request, timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as rpc_error:
            raise status.from_rpc_error(rpc_error) from None
        return response.text


class Client(ControlCalls):
    """The blocking client: same methods as `AsyncClient`; safe to share across threads."""

    _async: AsyncClient

    def __init__(self, target: str, **options: Any) -> None:
        """Takes `AsyncClient`'s keyword arguments (model, TLS PEMs, api_key, ...)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="headrace-client", daemon=True
        )
        self._thread.start()
        try:
            self._async = self._run(_make_async_client(target, options))
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._submit(coroutine).result()

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run on the client's loop, in the caller's trace context (its current span is the
        parent of the request's span)."""
        return asyncio.run_coroutine_threadsafe(
            _in_context(otel_context.get_current(), coroutine), self._loop
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._run(_cancel_other_tasks())  # what gRPC itself still runs on this loop
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def generate(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> GenerationResult:
        """See `AsyncClient.generate`."""
        return self._run(
            self._async.generate(
                prompt, config, priority=priority, timeout=timeout, adapter=adapter
            )
        )

    def chat(
        self,
        messages: Messages,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> GenerationResult:
        """See `AsyncClient.chat`."""
        prompt = Chat.of(messages)
        return self.generate(prompt, config, priority=priority, timeout=timeout, adapter=adapter)

    def stream_chat(
        self,
        messages: Messages,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> Iterator[StreamChunk]:
        """See `AsyncClient.stream_chat`."""
        prompt = Chat.of(messages)
        return self.stream(prompt, config, priority=priority, timeout=timeout, adapter=adapter)

    def stream(
        self,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        *,
        priority: int = 0,
        timeout: float | None = None,
        adapter: str = "",
    ) -> Iterator[StreamChunk]:
        """See `AsyncClient.stream`; closing the generator early cancels the request."""
        items: queue.SimpleQueue[StreamChunk | BaseException | None] = queue.SimpleQueue()

        async def pump() -> None:
            chunks = self._async.stream(
                prompt, config, priority=priority, timeout=timeout, adapter=adapter
            )
            try:
                async for chunk in chunks:
                    items.put(chunk)
            except Exception as error:
                items.put(error)
            else:
                items.put(None)

        future = self._submit(pump())
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def model_info(self, timeout: float | None = 30.0) -> pb.ModelInfo:
        return self._run(self._async.model_info(timeout))

    def tokenize(
        self,
        prompt: str | Chat,
        *,
        add_special_tokens: bool = True,
        timeout: float | None = 30.0,
    ) -> list[int]:
        """See `AsyncClient.tokenize`."""
        return self._run(
            self._async.tokenize(prompt, add_special_tokens=add_special_tokens, timeout=timeout)
        )

    def detokenize(self, token_ids: list[int], *, timeout: float | None = 30.0) -> str:
        """See `AsyncClient.detokenize`."""
        return self._run(self._async.detokenize(token_ids, timeout=timeout))


async def _in_context(context: otel_context.Context, coroutine: Coroutine[Any, Any, T]) -> T:
    token = otel_context.attach(context)
    try:
        return await coroutine
    finally:
        otel_context.detach(token)


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _make_async_client(target: str, options: dict[str, Any]) -> AsyncClient:
    """AsyncClient's channel binds to the loop it is made on, so it is made on the thread's."""
    return AsyncClient(target, **options)
