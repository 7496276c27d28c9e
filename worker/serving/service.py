"""The worker's gRPC services: `Generation` (clients, the router) and `WorkerControl`.

Design note. Each `Generate` stream is one `_Session`: a reader task turns incoming
`Request` / `Cancel` messages into engine commands, and the handler's own loop turns the
engine's per-step output batches into one `GenerateResponse` per step. Request ids are the
client's, so two streams may both use "1": the engine sees them prefixed with the stream's
number. A request that fails before reaching the engine (bad field, unknown model, draining)
is answered in-band on the same stream; nothing a single request does can end the stream.
Leaving the handler for any reason (the client cancelled, disconnected, or the server is
stopping) aborts whatever is still running on the stream, which frees its KV blocks within
one engine step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from headrace.sdk import serving, status, tracing, wire
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from headrace.sdk.outputs import FinishReason
from headrace.sdk.telemetry import RequestTelemetry
from headrace.worker.engine.async_engine import AsyncEngine, OutputStream
from headrace.worker.engine.engine import RequestOutput, RequestTimes
from headrace.worker.serving.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
#: One line per finished request (level INFO).
request_logger = logging.getLogger("headrace.worker.requests")

DEFAULT_LOAD_INTERVAL_S = 1.0
MIN_LOAD_INTERVAL_S = 0.01
DEFAULT_DRAIN_GRACE_S = 30.0


class ServingState:
    """What the services share: whether the worker drains, and how many requests are live."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0
        self.num_admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def started(self) -> None:
        self.num_in_flight += 1
        self.num_admitted += 1
        self._idle.clear()

    def ended(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass(slots=True)
class _Live:
    """A request of a session that reached the engine and has not finished."""

    engine_id: str
    timer: asyncio.TimerHandle | None
    return_prompt_token_ids: bool
    telemetry: RequestTelemetry


@dataclass(slots=True)
class _Session:
    """The requests of one stream (one `Generate` RPC, or one `GenerateOne`)."""

    service: GenerationService
    prefix: str
    stream: OutputStream
    #: The call's metadata: a request without a trace context of its own joins its trace.
    metadata: Sequence[tuple[str, str | bytes]]
    live: dict[str, _Live] = field(default_factory=dict)
    #: In-band answers to requests that never reached the engine, sent with the next response.
    rejected: list[pb.Chunk] = field(default_factory=list)
    input_done: bool = False

    @property
    def is_done(self) -> bool:
        return self.input_done and not self.live and not self.rejected

    def submit(self, request: pb.Request) -> None:
        parent = tracing.parent_context(request.trace_context, self.metadata)
        telemetry = RequestTelemetry.start("worker.generate", request.request_id, parent)
        try:
            parsed = self.service.admit(request)
            if parsed.request_id in self.live:
                raise InvalidArgumentError(
                    "request_id", f"{parsed.request_id!r} is already in flight on this stream"
                )
        except HeadraceError as error:
            self.service.finish(telemetry, FinishReason.ERROR, None, error)
            self.reject(request.request_id, error)
            return
        engine_id = self.prefix + parsed.request_id
        engine = self.service.engine
        timer = None
        if parsed.timeout_s is not None:
            expired = DeadlineExceededError(f"timeout of {parsed.timeout_s:g} s passed")
            loop = asyncio.get_running_loop()
            timer = loop.call_later(parsed.timeout_s, engine.abort, engine_id, expired)
        self.live[parsed.request_id] = _Live(
            engine_id, timer, request.return_prompt_token_ids, telemetry
        )
        self.service.state.started()
        engine.add_request(engine_id, parsed.prompt, parsed.config, self.stream, parsed.priority)

    def cancel(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is not None:
            self.service.engine.abort(live.engine_id)

    def reject(self, request_id: str, error: HeadraceError) -> None:
        self.rejected.append(status.error_chunk(request_id, error))
        self.wake()

    def wake(self) -> None:
        self.stream.put([])

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """One response per engine step that touched this session, until it is done."""
        while not self.is_done:
            outputs = await self.stream.get()
            response = pb.GenerateResponse()
            response.chunks.extend(self.rejected)
            self.rejected.clear()
            now_s = time.monotonic()
            for output in outputs:
                response.chunks.extend(self._chunks(output, now_s))
            if response.chunks:
                yield response

    def _chunks(self, output: RequestOutput, now_s: float) -> list[pb.Chunk]:
        request_id = output.request_id.removeprefix(self.prefix)
        chunks = [
            pb.Chunk(
                request_id=request_id,
                index=delta.index,
                token_ids=delta.token_ids,
                text=delta.text,
                logprobs=wire.logprobs_to_wire(delta.logprobs),
                finish_reason=wire.finish_reason_to_wire(delta.finish_reason),
            )
            for delta in output.samples
        ] or [pb.Chunk(request_id=request_id)]
        if output.prompt_logprobs is not None:
            chunks[0].prompt_logprobs.extend(wire.logprobs_to_wire(output.prompt_logprobs))
        live = self.live.get(request_id)
        if live is None:
            return chunks
        num_tokens = sum(len(delta.token_ids) for delta in output.samples)
        live.telemetry.clock.tokens(now_s, num_tokens, self.service.metrics.requests)
        if output.prompt_token_ids is not None and live.return_prompt_token_ids:
            chunks[0].prompt_token_ids.extend(output.prompt_token_ids)
        if output.finished:
            last = chunks[-1]
            last.finished = True
            if output.usage is not None:
                last.usage.CopyFrom(wire.usage_to_wire(output.usage))
            if output.error is not None:
                last.error.CopyFrom(status.to_wire(output.error))
            self._forget(request_id, output)
        return chunks

    def _forget(self, request_id: str, output: RequestOutput | None) -> None:
        live = self.live.pop(request_id, None)
        if live is None:
            return
        if live.timer is not None:
            live.timer.cancel()
        self.service.state.ended()
        if output is None:  # the stream went away
            self.service.finish(live.telemetry, FinishReason.ABORT, None, None)
            return
        reasons = [delta.finish_reason for delta in output.samples if delta.finish_reason]
        reason = FinishReason.ERROR if output.error is not None else reasons[-1]
        self.service.finish(live.telemetry, reason, output, output.error)

    def close(self) -> None:
        """The stream is gone: stop its live requests (their outputs are dropped)."""
        for request_id in list(self.live):
            self.service.engine.abort(self.live[request_id].engine_id)
            self._forget(request_id, None)


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        model_info: pb.ModelInfo,
        state: ServingState,
        metrics: WorkerMetrics,
    ) -> None:
        self.engine = engine
        self.model_info = model_info
        self.state = state
        self.metrics = metrics
        self._stream_numbers = itertools.count()

    def admit(self, request: pb.Request) -> wire.ParsedRequest:
        """Check a request against this server; raises the typed error that refuses it."""
        if self.state.draining:
            raise UnavailableError("the worker is draining and takes no new requests")
        parsed = wire.request_from_wire(request)
        if parsed.model and parsed.model != self.model_info.name:
            raise NotFoundError(
                f"model: {parsed.model!r} is not served here (this worker serves "
                f"{self.model_info.name!r})"
            )
        return parsed

    def finish(
        self,
        telemetry: RequestTelemetry,
        reason: FinishReason,
        output: RequestOutput | None,
        error: HeadraceError | None,
    ) -> None:
        """A request ended: its metrics, its span (with queue, prefill and decode as child
        spans, from the engine's times) and its log line."""
        times = output.times if output is not None else None
        queue_s = None
        if times is not None and times.first_scheduled_s is not None:
            requests = self.metrics.requests
            queue_s = telemetry.queued(times.arrival_s, times.first_scheduled_s, requests)
            if telemetry.span.is_recording():
                _phase_spans(telemetry, times)
        usage = output.usage if output is not None else None
        telemetry.finish(
            reason, usage, error, self.metrics.requests, request_logger, queue_s=queue_s
        )

    def _session(self, context: grpc.aio.ServicerContext) -> _Session:
        metadata = tuple(context.invocation_metadata() or ())
        return _Session(self, f"s{next(self._stream_numbers)}/", OutputStream(), metadata)

    # grpc.aio needs the handlers themselves to be async generators, hence the loops.
    async def Generate(
        self,
        request_iterator: AsyncIterator[pb.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in serving.serve_stream(self._session(context), request_iterator):
            yield response

    async def GenerateOne(
        self, request: pb.Request, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in serving.serve_one(self._session(context), request, context):
            yield response

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return self.model_info


class WorkerControlService(worker_pb2_grpc.WorkerControlServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        state: ServingState,
        drain: Callable[[float], Awaitable[object]],
        max_model_len: int,
    ) -> None:
        self.engine = engine
        self.state = state
        self._drain = drain
        self.max_model_len = max_model_len

    def report(self) -> worker_pb2.LoadReport:
        load = self.engine.load
        return worker_pb2.LoadReport(
            free_kv_blocks=load.num_free_blocks,
            total_kv_blocks=load.num_total_blocks,
            block_size=load.block_size,
            running_requests=load.num_running_requests,
            waiting_requests=load.num_waiting_requests,
            queued_tokens=load.num_queued_tokens,
            prefix_cache_hit_blocks=load.num_prefix_hit_blocks,
            draining=self.state.draining,
            max_model_len=self.max_model_len,
            admitted_requests=self.state.num_admitted,
        )

    async def WatchLoad(
        self, request: worker_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.LoadReport]:
        interval_s = DEFAULT_LOAD_INTERVAL_S
        if request.HasField("interval") and request.interval.ToNanoseconds() > 0:
            interval_s = max(MIN_LOAD_INTERVAL_S, request.interval.ToNanoseconds() / 1e9)
        while True:
            yield self.report()
            await asyncio.sleep(interval_s)

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        grace_s = DEFAULT_DRAIN_GRACE_S
        if request.HasField("grace"):
            grace_s = max(0.0, request.grace.ToNanoseconds() / 1e9)
        await self._drain(grace_s)
        return worker_pb2.DrainResponse(remaining_requests=self.state.num_in_flight)


def _phase_spans(telemetry: RequestTelemetry, times: RequestTimes) -> None:
    """prefill → decode under the request's span (after `queue`), as far as it got."""
    assert times.first_scheduled_s is not None and times.finished_s is not None
    prefill_end_s = times.first_token_s or times.finished_s
    tracing.child_span(telemetry.span, "prefill", times.first_scheduled_s, prefill_end_s)
    if times.first_token_s is not None:
        tracing.child_span(telemetry.span, "decode", times.first_token_s, times.finished_s)


def model_info(engine: AsyncEngine, name: str) -> pb.ModelInfo:
    """Describe the engine's model for `GetModelInfo`."""
    core = engine.engine
    tokenizer = core.tokenizer
    info = pb.ModelInfo(
        name=name,
        model_type=str(getattr(core.hf_config, "model_type", "")),
        max_model_len=core.max_model_len,
        dtype=str(core.dtype).removeprefix("torch."),
        vocab_size=core.vocab_size,
        eos_token_ids=sorted(core.eos_token_ids),
    )
    for role in ("bos", "eos", "pad"):
        text, token_id = getattr(tokenizer, f"{role}_token"), getattr(tokenizer, f"{role}_token_id")
        if text is not None and token_id is not None:
            getattr(info, f"{role}_token").CopyFrom(pb.SpecialToken(text=str(text), id=token_id))
    for text, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True):
        info.special_tokens.append(pb.SpecialToken(text=text, id=token_id))
    return info
