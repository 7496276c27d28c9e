"""One `Generate` stream on the worker: its requests from admission to their last chunk.

Design note. Each `Generate` stream is one `WorkerSession`: a reader task turns incoming
`Request` / `Cancel` / `Pause` / `Resume` messages into engine commands, and the handler's
own loop turns the engine's per-step output batches into one `GenerateResponse` per step.
Request ids are the client's, so two streams may both use "1": the engine sees them prefixed
with the stream's number. A request that fails before reaching the engine (bad field,
unknown model, draining) is answered in-band on the same stream, and a request reusing the
id of one in flight is refused in the response's `duplicates` without touching that one;
nothing a single request does can end the stream. Leaving the handler for any reason (the
client cancelled, disconnected, or the server is stopping) aborts whatever is still running
on the stream, which frees its KV blocks within one engine step.

Flow control: the session's `FlowControl` (see `headrace.sdk.streams`) is its
`OutputStream`'s hooks. When unsent responses pile up (the client stopped reading), every
request of the stream is held in the engine; a client's own `Pause` holds the requests it
names. A request held longer than the slow-reader timeout ends with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.sdk import auth, status, streams, tracing, wire
from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.sdk.outputs import FinishReason, Usage
from headrace.sdk.streams import FlowControl, SessionBase
from headrace.sdk.telemetry import RequestTelemetry
from headrace.worker.engine.async_engine import OutputStream
from headrace.worker.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from headrace.worker.serving.service import GenerationService


@dataclass(slots=True)
class _Live:
    """A request of a session that reached the engine and has not finished."""

    engine_id: str
    timer: asyncio.TimerHandle | None
    return_prompt_token_ids: bool
    telemetry: RequestTelemetry
    #: What it streamed so far (for the log line of a request whose stream went away).
    usage: Usage = field(default_factory=Usage)


@dataclass(slots=True)
class WorkerSession(SessionBase):
    """The requests of one stream (one `Generate` RPC, or one `GenerateOne`)."""

    service: GenerationService
    prefix: str
    #: The call's metadata: a request without a trace context of its own joins its trace.
    metadata: Sequence[tuple[str, str | bytes]]
    live: dict[str, _Live] = field(default_factory=dict)
    #: In-band answers to requests that never reached the engine, sent with the next response.
    rejected: list[pb.Chunk] = field(default_factory=list)
    #: Refusals of requests that reused an id in flight, sent with the next response.
    duplicates: list[pb.DuplicateRequest] = field(default_factory=list)
    input_done: bool = False
    fault: HeadraceError | None = None
    flow: FlowControl = field(init=False)
    stream: OutputStream = field(init=False)
    #: The call's API key, when it has per-request limits (see `headrace.sdk.auth`).
    caller: auth.Caller | None = field(init=False)

    def __post_init__(self) -> None:
        limits = self.service.flow
        self.flow = FlowControl(limits, self._hold, self._release, self._expire)
        self.stream = OutputStream(limits=limits, hooks=self.flow)
        self.caller = auth.current_caller()

    @property
    def is_done(self) -> bool:
        if self.fault is not None:
            return True
        return self.input_done and not self.live and not self.rejected and not self.duplicates

    def submit(self, request: pb.Request) -> None:
        if request.request_id in self.live:
            self._refuse_duplicate(request.request_id)
            return
        parent = tracing.parent_context(request.trace_context, self.metadata)
        telemetry = RequestTelemetry.start("worker.generate", request.request_id, parent)
        try:
            parsed = self.service.admit(request, self.caller)
        except HeadraceError as error:
            self.service.finish(telemetry, FinishReason.ERROR, error)
            self.reject(request.request_id, error)
            return
        engine_id = self.prefix + parsed.request_id
        engine = self.service.engine
        timer = streams.start_timeout(parsed.timeout_s, lambda e: engine.abort(engine_id, e))
        live = _Live(engine_id, timer, request.return_prompt_token_ids, telemetry)
        self.live[parsed.request_id] = live
        self.service.state.started()
        engine.add_request(
            engine_id,
            parsed.prompt,
            parsed.config,
            self.stream,
            priority=parsed.priority,
            adapter=parsed.adapter or None,
            num_resumed_tokens=parsed.num_resumed_tokens,
        )
        self.flow.add(parsed.request_id)

    def _refuse_duplicate(self, request_id: str) -> None:
        error = InvalidArgumentError(
            "request_id", f"{request_id!r} is already in flight on this stream"
        )
        self.duplicates.append(
            pb.DuplicateRequest(request_id=request_id, error=status.to_wire(error))
        )
        self.wake()

    def cancel(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is not None:
            self.service.engine.abort(live.engine_id)

    def reject(self, request_id: str, error: HeadraceError) -> None:
        self.rejected.append(status.error_chunk(request_id, error))
        self.wake()

    def wake(self) -> None:
        self.stream.put([])

    # --- flow control (the session's side of its FlowControl) ---------------------------

    def _hold(self, request_id: str) -> None:
        self.service.engine.hold([self.live[request_id].engine_id])

    def _release(self, request_id: str) -> None:
        self.service.engine.release([self.live[request_id].engine_id])

    def _expire(self, request_id: str, error: HeadraceError) -> None:
        self.service.engine.abort(self.live[request_id].engine_id, error)

    # --- responses ----------------------------------------------------------------------

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """One response per engine step that touched this session, until it is done."""
        while not self.is_done:
            outputs = await self.stream.get()
            response = pb.GenerateResponse(chunks=self.rejected, duplicates=self.duplicates)
            self.rejected, self.duplicates = [], []
            now_s = time.monotonic()
            for output in outputs:
                response.chunks.extend(self._chunks(output, now_s))
            if response.chunks or response.duplicates:
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
                weight_version=output.weight_version,
                # A beam's (None, the non-beam case, leaves them unset).
                cumulative_logprob=delta.cumulative_logprob,
                beam_score=delta.beam_score,
            )
            for delta in output.samples
        ] or [pb.Chunk(request_id=request_id, weight_version=output.weight_version)]
        if output.prompt_logprobs is not None:
            chunks[0].prompt_logprobs.extend(wire.logprobs_to_wire(output.prompt_logprobs))
        if output.first_prompt_token is not None:
            chunks[0].first_prompt_token.CopyFrom(wire.logprob_to_wire(output.first_prompt_token))
            chunks[0].prompt_text = output.prompt_text or ""
        live = self.live.get(request_id)
        if live is None:
            return chunks
        self._count(live, output, now_s)
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

    def _count(self, live: _Live, output: RequestOutput, now_s: float) -> None:
        num_tokens = sum(len(delta.token_ids) for delta in output.samples)
        live.telemetry.clock.tokens(now_s, num_tokens, self.service.metrics.requests)
        live.usage.num_generated_tokens += num_tokens
        if output.prompt_token_ids is not None:
            live.usage.num_prompt_tokens = len(output.prompt_token_ids)

    def _forget(self, request_id: str, output: RequestOutput | None) -> None:
        live = self.live.pop(request_id, None)
        if live is None:
            return
        if live.timer is not None:
            live.timer.cancel()
        self.flow.remove(request_id)
        self.service.state.ended()
        if self.caller is not None:
            self.caller.done()
        if output is None:  # the stream went away
            self.service.finish(live.telemetry, FinishReason.ABORT, None, live.usage)
            return
        reasons = [delta.finish_reason for delta in output.samples if delta.finish_reason]
        reason = FinishReason.ERROR if output.error is not None else reasons[-1]
        usage = output.usage or live.usage
        self.service.finish(live.telemetry, reason, output.error, usage, output.times)

    def close(self) -> None:
        """The stream is gone: stop its live requests (their outputs are dropped)."""
        for request_id in list(self.live):
            self.service.engine.abort(self.live[request_id].engine_id)
            self._forget(request_id, None)
