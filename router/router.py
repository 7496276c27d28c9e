"""The router: admission, the priority queue, dispatch, failover.

Design note. Everything runs on one event loop, so the router's state needs no locks. A
client's `Generate` stream is a `RouterSession` like the worker's: its requests are admitted
(or refused in-band), queued by priority, and dispatched whenever a worker has room:
`_dispatch` runs after every event that can make room (a new request, a finished one, a
load report, a worker coming up). Dispatch is strictly head-of-line: if the best-placed
request cannot go anywhere, nothing behind it jumps ahead. Chunks from a worker's stream are
rewritten for their clients and grouped so each worker step becomes one message per
client stream. When a worker goes down, its requests re-enter the queue at their original
place and resume elsewhere (see `RoutedRequest`), but only on a worker serving the weight
version that produced their tokens so far: with none, they fail (UNAVAILABLE) rather than
mix two policies in one sample.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc
import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.router.admission import affinity_text, check_fits, estimate_tokens
from headrace.router.config import RouterConfig
from headrace.router.metrics import RouterMetrics
from headrace.router.policy import make_policy
from headrace.router.queue import PriorityQueue
from headrace.router.request import RoutedRequest
from headrace.router.workers import WorkerLink, WorkerPool
from headrace.sdk import serving, status, tracing, wire
from headrace.sdk.credentials import Metadata
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    ResourceExhaustedError,
    UnavailableError,
)
from headrace.sdk.outputs import FinishReason
from headrace.sdk.prompts import Chat, Prompt
from headrace.sdk.streams import ResponseQueue
from headrace.sdk.telemetry import RequestTelemetry

logger = logging.getLogger(__name__)
#: One line per finished request (level INFO).
request_logger = logging.getLogger("headrace.router.requests")
T = TypeVar("T")


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.queue: PriorityQueue[RoutedRequest] = PriorityQueue(config.aging_per_s)
        self.pool = WorkerPool(config, self)
        self.policy = make_policy(config)
        self.metrics = RouterMetrics()
        self.metrics.watch(self)
        self.draining = False
        #: Requests admitted and not finished (queued or on a worker).
        self.active = serving.InFlight()
        self._no_worker_since: float | None = time.monotonic()
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.pool.start()
        self._watchdog = asyncio.create_task(self._watch_for_workers())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.pool.close()

    @property
    def has_healthy_worker(self) -> bool:
        """Some worker is in rotation: up, and not draining."""
        return bool(self.pool.accepting())

    # --- admission ------------------------------------------------------------------------

    def admit(
        self,
        wire_request: pb.Request,
        outbox: ResponseQueue[list[pb.Chunk]],
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> RoutedRequest:
        """Queue a request; raises the typed error that refuses it. ``metadata`` is the
        call's: a request without a trace context of its own joins the call's trace."""
        retry_after_s = self.config.retry_after_s
        if self.draining:
            raise UnavailableError(
                "the router is draining; it takes no new requests", retry_after_s
            )
        parsed = wire.request_from_wire(wire_request)
        if not self.has_healthy_worker:
            raise UnavailableError("no healthy worker takes requests", retry_after_s)
        check_fits(parsed.prompt, [link.report for link in self.pool.accepting()])
        num_tokens = estimate_tokens(parsed.prompt)
        if (
            len(self.queue) >= self.config.max_queued_requests
            or self.queue.num_tokens + num_tokens > self.config.max_queued_tokens
        ):
            raise ResourceExhaustedError(
                f"the router's queue is full ({len(self.queue)} requests, "
                f"{self.queue.num_tokens} tokens)",
                retry_after_s=self.config.retry_after_s,
            )
        parent = tracing.parent_context(wire_request.trace_context, metadata)
        telemetry = RequestTelemetry.start("router.generate", parsed.request_id, parent)
        request = RoutedRequest(
            client_id=parsed.request_id,
            outbox=outbox,
            original=wire_request,
            parsed=parsed,
            num_tokens_estimate=num_tokens,
            affinity_key=self._affinity_key(parsed.prompt, parsed.adapter),
            telemetry=telemetry,
        )
        request.start_timeout(lambda error: self.fail(request, error))
        self.active.started()
        self.queue.push(request, parsed.priority, request.arrival_s, num_tokens)
        self._dispatch()
        return request

    def _affinity_key(self, prompt: Prompt, adapter: str) -> bytes:
        """What prefix-affinity hashes: the prompt's head, under its LoRA adapter (a worker's
        prefix cache never shares KV between adapters, so neither does affinity)."""
        scope = f"lora:{adapter}:".encode() if adapter else b""
        if isinstance(prompt, str | Chat):
            return scope + affinity_text(prompt)[: self.config.affinity_prefix_chars].encode()
        head = prompt[: self.config.affinity_prefix_tokens]
        return scope + b"ids:" + b",".join(str(t).encode() for t in head)

    # --- dispatch -------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while (request := self.queue.peek()) is not None:
            candidates = [link for link in self.pool.links.values() if link.has_room(request)]
            if not candidates:
                if not self._version_served(request):
                    self.fail(request, self._version_gone(request))
                    continue
                return
            self.queue.pop()
            link = self.policy.choose(request, candidates)
            link.send(request)
            self._record_dispatch(request, link)

    def _version_served(self, request: RoutedRequest) -> bool:
        """Some worker in rotation serves the weights the request must resume on."""
        wanted = request.required_version
        return not wanted or any(link.weight_version == wanted for link in self.pool.accepting())

    def _version_gone(self, request: RoutedRequest) -> UnavailableError:
        return UnavailableError(
            f"no worker serves weight version {request.required_version!r}, which produced "
            f"this request's first {len(request.streamed_token_ids)} tokens; it is not "
            "resumed on other weights",
            self.config.retry_after_s,
        )

    def _record_dispatch(self, request: RoutedRequest, link: WorkerLink) -> None:
        span = request.telemetry.span
        # Its first dispatch ends its wait in the queue (a request goes back to the queue
        # only to fail over).
        if not request.num_failovers:
            request.telemetry.queued(
                request.arrival_s, request.first_dispatch_s, self.metrics.requests
            )
        span.add_event(
            "dispatched",
            {"headrace.worker": link.target, "headrace.failovers": request.num_failovers},
        )

    # --- events from worker links (LinkEvents) --------------------------------------------

    def on_response(self, link: WorkerLink, response: pb.GenerateResponse) -> None:
        by_outbox: dict[int, tuple[ResponseQueue[list[pb.Chunk]], list[pb.Chunk]]] = {}
        finished = False
        now_s = time.monotonic()
        for chunk in response.chunks:
            request = link.inflight.get(chunk.request_id)
            if request is None:
                continue  # cancelled or timed out here already
            if request.is_from_other_weights(chunk):
                self.fail(request, self._version_gone(request))
                continue
            request.telemetry.clock.tokens(now_s, len(chunk.token_ids), self.metrics.requests)
            out = request.to_client(chunk)
            if out.finished:
                link.forget(request)
                self._end(request, out)
                finished = True
            if not request.cancelled or out.finished:
                by_outbox.setdefault(id(request.outbox), (request.outbox, []))[1].append(out)
        for outbox, chunks in by_outbox.values():
            outbox.put(chunks)
        if finished:
            self._dispatch()

    def on_down(self, link: WorkerLink, orphans: list[RoutedRequest]) -> None:
        for request in orphans:
            self._resume(request, link)
        self._dispatch()

    def on_change(self) -> None:
        if self.has_healthy_worker:
            self._no_worker_since = None
        elif self._no_worker_since is None:
            self._no_worker_since = time.monotonic()
        self._dispatch()
        self._fail_queued_if_no_worker()

    def _resume(self, request: RoutedRequest, link: WorkerLink) -> None:
        if request.done:
            return
        if request.cancelled:
            self._finish_locally(request, pb.FINISH_REASON_CANCELLED)
            return
        config = request.parsed.config
        # A beam search streams nothing before its end, so it restarts whole from its
        # original prompt, whatever its n; other samples cannot resume one by one.
        if config.n > 1 and not config.is_beam_search:
            error = UnavailableError(
                f"worker {link.target} failed; requests with n > 1 are not resumed elsewhere"
            )
            self.fail(request, error)
            return
        if request.streamed_token_ids and request.remaining_tokens <= 0:
            self._finish_locally(request, pb.FINISH_REASON_LENGTH)
            return
        request.fail_over()
        self.metrics.failovers.inc()
        request.telemetry.span.add_event("failover", {"headrace.worker": link.target})
        logger.info("resuming request %s elsewhere", request.client_id)
        self.queue.push(
            request, request.parsed.priority, request.arrival_s, request.num_tokens_estimate
        )

    # --- ending requests --------------------------------------------------------------------

    def cancel(self, request: RoutedRequest) -> None:
        """The client cancelled: stop it wherever it is; its last chunk says CANCELLED."""
        if request.done or request.cancelled:
            return
        request.mark_cancelled()
        if self.queue.remove(request):
            self._finish_locally(request, pb.FINISH_REASON_CANCELLED)
        elif request.worker is not None:
            request.worker.cancel(request)  # the worker's last chunk comes back

    def _stop(self, request: RoutedRequest) -> None:
        """Take the request out of the queue or off its worker; nothing more is routed."""
        self.queue.remove(request)
        if request.worker is not None:
            request.worker.cancel(request)
            request.worker.forget(request)

    def abandon(self, request: RoutedRequest) -> None:
        """The client is gone: stop the request and send nothing more."""
        if request.done:
            return
        self._stop(request)
        self._end(request, None)

    def fail(self, request: RoutedRequest, error: HeadraceError) -> None:
        """End a request with an in-band error (a timeout, an unresumable failover)."""
        if request.done:
            return
        self._stop(request)
        chunk = status.error_chunk(request.client_id, error)
        self._end(request, chunk)
        request.outbox.put([chunk])
        self._dispatch()

    def _finish_locally(self, request: RoutedRequest, reason: pb.FinishReason) -> None:
        usage = wire.usage_to_wire(request.usage())
        chunk = pb.Chunk(
            request_id=request.client_id, finish_reason=reason, finished=True, usage=usage
        )
        self._end(request, chunk)
        request.outbox.put([chunk])

    def _end(self, request: RoutedRequest, last: pb.Chunk | None) -> None:
        """The request is over; ``last`` is its last chunk to the client (None: the client
        is gone)."""
        request.end()
        self._record_end(request, last)
        self.active.ended()

    def _record_end(self, request: RoutedRequest, last: pb.Chunk | None) -> None:
        reason, usage, error = FinishReason.ABORT, request.usage(), None
        if last is not None:
            reason = wire.finish_reason_from_wire(last.finish_reason) or FinishReason.STOP
            if last.HasField("usage"):
                usage = wire.usage_from_wire(last.usage)
            error = status.from_wire(last.error) if last.HasField("error") else None
        queue_s = request.first_dispatch_s - request.arrival_s if request.first_dispatch_s else None
        request.telemetry.finish(
            reason,
            usage,
            error,
            self.metrics.requests,
            request_logger,
            queue_s=queue_s,
            worker=request.worker.target if request.worker is not None else None,
            worker_request_id=request.wire_id or None,
            failovers=request.num_failovers or None,
        )

    def _fail_queued_if_no_worker(self) -> None:
        """Queued requests do not wait for workers that will not take them: they fail with
        UNAVAILABLE (and a retry hint) at once when every worker is draining or down after
        draining, or once none has been in rotation for `unavailable_after_s` (a worker that
        died may restart within that time and resume them)."""
        since = self._no_worker_since
        if since is None or not len(self.queue):
            return
        leaving = self.pool.all_leaving()
        if not leaving and time.monotonic() - since < self.config.unavailable_after_s:
            return
        reason = "every worker is draining" if leaving else "no healthy worker takes requests"
        for request in self.queue.items():
            self.fail(request, UnavailableError(reason, self.config.retry_after_s))

    async def _watch_for_workers(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self._fail_queued_if_no_worker()

    def hold(self, request: RoutedRequest) -> None:
        """Hold a request for its slow reader, on its worker now and on any worker it fails
        over to (until `release`)."""
        request.hold()
        if request.worker is not None:
            request.worker.hold(request)

    def release(self, request: RoutedRequest) -> None:
        request.release()
        if request.worker is not None:
            request.worker.release(request)

    async def ask_a_worker(
        self, call: Callable[[generation_pb2_grpc.GenerationStub, Metadata], Awaitable[T]]
    ) -> T:
        """A unary `Generation` call (``call(stub, metadata)``) answered by a healthy worker:
        the next one when a worker is unavailable; a worker's refusal (a bad field, an unknown
        model) raises as its typed error."""
        for link in self.pool.accepting():
            stub = generation_pb2_grpc.GenerationStub(link.channel)
            try:
                return await call(stub, link.metadata)
            except grpc.RpcError as rpc_error:
                error = status.from_rpc_error(rpc_error)
                if not isinstance(error, UnavailableError | DeadlineExceededError):
                    raise error from None
        raise UnavailableError("no healthy worker", self.config.retry_after_s)

    async def model_info(self) -> pb.ModelInfo:
        for link in self.pool.accepting():
            stub = generation_pb2_grpc.GenerationStub(link.channel)
            try:
                info: pb.ModelInfo = await stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=10, metadata=link.metadata
                )
            except grpc.RpcError:
                continue
            return info
        raise UnavailableError("no healthy worker")
