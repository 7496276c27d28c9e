"""One `Generate` stream on the worker: its requests from admission to their last chunk.

Design note. Each `Generate` stream is one `WorkerSession`: a reader task turns incoming
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
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.sdk import serving, status, tracing, wire
from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
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


@dataclass(slots=True)
class WorkerSession:
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
        timer = serving.start_timeout(parsed.timeout_s, lambda e: engine.abort(engine_id, e))
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
