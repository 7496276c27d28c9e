"""The worker's `Generation` service (clients, the router): one `WorkerSession` per stream."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator

import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import auth, serving, status, streams, tracing, wire
from headrace.sdk.errors import HeadraceError, NotFoundError, UnavailableError
from headrace.sdk.outputs import FinishReason, Usage
from headrace.sdk.streams import FlowLimits
from headrace.sdk.telemetry import RequestTelemetry
from headrace.sdk.tool_formats import format_of_template
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.engine.outputs import RequestTimes
from headrace.worker.serving.metrics import WorkerMetrics
from headrace.worker.serving.session import WorkerSession

logger = logging.getLogger(__name__)
#: One line per finished request (level INFO).
request_logger = logging.getLogger("headrace.worker.requests")


class ServingState(serving.InFlight):
    """What the services share: requests in flight, whether the worker drains, and how many
    requests it ever admitted (load reports carry it)."""

    def __init__(self) -> None:
        super().__init__()
        self.draining = False
        self.num_admitted = 0

    def started(self) -> None:
        super().started()
        self.num_admitted += 1


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        model_info: pb.ModelInfo,
        state: ServingState,
        metrics: WorkerMetrics,
        flow: FlowLimits,
    ) -> None:
        self.engine = engine
        self.model_info = model_info
        self.state = state
        self.metrics = metrics
        self.flow = flow
        self._stream_numbers = itertools.count()

    def admit(self, request: pb.Request, caller: auth.Caller | None) -> wire.ParsedRequest:
        """Check a request against this server (and the caller's key); raises the typed
        error that refuses it. A request it lets in counts against the key until it ends."""
        if self.state.draining:
            raise UnavailableError("the worker is draining and takes no new requests")
        parsed = wire.request_from_wire(request)
        self._check_model(parsed.model)
        refusal = caller.admit(request) if caller is not None else None
        if refusal is not None:
            raise refusal
        return parsed

    def finish(
        self,
        telemetry: RequestTelemetry,
        reason: FinishReason,
        error: HeadraceError | None,
        usage: Usage | None = None,
        times: RequestTimes | None = None,
    ) -> None:
        """A request ended: its metrics, its span (with queue, prefill and decode as child
        spans, from the engine's times) and its log line."""
        queue_s = None
        if times is not None and times.first_scheduled_s is not None:
            # From the worker's arrival, not the engine's: a request waits for the step in
            # progress before the engine takes it in.
            requests = self.metrics.requests
            arrival_s = telemetry.clock.arrival_s
            queue_s = telemetry.queued(arrival_s, times.first_scheduled_s, requests)
            if times.first_token_s is not None:
                self.metrics.prefill_time.observe(times.first_token_s - times.first_scheduled_s)
            if telemetry.span.is_recording():
                _phase_spans(telemetry, times)
        telemetry.finish(
            reason, usage, error, self.metrics.requests, request_logger, queue_s=queue_s
        )

    def _session(self, context: grpc.aio.ServicerContext) -> WorkerSession:
        metadata = tuple(context.invocation_metadata() or ())
        return WorkerSession(self, f"s{next(self._stream_numbers)}/", metadata)

    # Stream-response handlers are coroutines that write with context.write (see streams).
    async def Generate(
        self,
        request_iterator: AsyncIterator[pb.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        await streams.serve_stream(self._session(context), request_iterator, context)

    async def GenerateOne(self, request: pb.Request, context: grpc.aio.ServicerContext) -> None:
        await streams.serve_one(self._session(context), request, context)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return self.model_info

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            self._check_model(request.model)
            prompt = wire.tokenize_prompt_from_wire(request)
            add_special_tokens = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            token_ids = await self.engine.tokenize(prompt, add_special_tokens)
        except Exception as error:
            await status.abort(context, error)
        return pb.TokenizeResponse(token_ids=token_ids, max_model_len=self.model_info.max_model_len)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        try:
            self._check_model(request.model)
            text = await self.engine.detokenize(list(request.token_ids))
        except Exception as error:
            await status.abort(context, error)
        return pb.DetokenizeResponse(text=text)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_info.name:
            raise NotFoundError(
                f"model: {model!r} is not served here (this worker serves {self.model_info.name!r})"
            )


def _phase_spans(telemetry: RequestTelemetry, times: RequestTimes) -> None:
    """prefill → decode under the request's span (after `queue`), as far as it got."""
    assert times.first_scheduled_s is not None and times.finished_s is not None
    prefill_end_s = times.first_token_s or times.finished_s
    tracing.child_span(telemetry.span, "prefill", times.first_scheduled_s, prefill_end_s)
    if times.first_token_s is not None:
        tracing.child_span(telemetry.span, "decode", times.first_token_s, times.finished_s)


def model_info(engine: AsyncEngine, name: str, tool_call_parser: str | None = None) -> pb.ModelInfo:
    """Describe the engine's model for `GetModelInfo`; ``tool_call_parser``: the format of
    the model's tool calls, None to read it from the chat template."""
    spec = engine.spec
    tokenizer = spec.tokenizer
    if tool_call_parser is None:
        tool_call_parser = format_of_template(tokenizer.chat_template)
    info = pb.ModelInfo(
        name=name,
        model_type=str(getattr(spec.hf_config, "model_type", "")),
        max_model_len=spec.max_model_len,
        dtype=str(spec.dtype).removeprefix("torch."),
        vocab_size=engine.vocab_size,
        eos_token_ids=sorted(spec.eos_token_ids),
        has_chat_template=bool(tokenizer.chat_template),
        tool_call_parser=tool_call_parser,
    )
    for role in ("bos", "eos", "pad"):
        text, token_id = getattr(tokenizer, f"{role}_token"), getattr(tokenizer, f"{role}_token_id")
        if text is not None and token_id is not None:
            getattr(info, f"{role}_token").CopyFrom(pb.SpecialToken(text=str(text), id=token_id))
    for text, token_id in zip(tokenizer.all_special_tokens, tokenizer.all_special_ids, strict=True):
        info.special_tokens.append(pb.SpecialToken(text=text, id=token_id))
    return info
