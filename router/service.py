"""The router's `Generation` service: admission, the priority queue, dispatch, failover.

Design note. Everything runs on one event loop, so the router's state needs no locks. A
client's `Generate` stream is a `_Session` like the worker's: its requests are admitted
(or refused in-band), queued by priority, and dispatched whenever a worker has room:
`_dispatch` runs after every event that can make room (a new request, a finished one, a
load report, a worker coming up). Dispatch is strictly head-of-line: if the best-placed
request cannot go anywhere, nothing behind it jumps ahead. Chunks from a worker's stream are
rewritten for their clients and grouped so each worker step becomes one message per
client stream. When a worker goes down, its requests re-enter the queue at their original
place and resume elsewhere (see `RoutedRequest`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.router.config import RouterConfig
from headrace.router.policy import make_policy
from headrace.router.queue import PriorityQueue
from headrace.router.request import RoutedRequest
from headrace.router.workers import WorkerLink, WorkerPool
from headrace.sdk import serving, status, wire
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4


@dataclass(slots=True)
class RouterStats:
    """Counters for benchmarks and tests (metrics come with the observability issue)."""

    num_failovers: int = 0
    #: Seconds from arrival to the first token, per finished request.
    ttft_s: list[float] = field(default_factory=list)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.queue: PriorityQueue[RoutedRequest] = PriorityQueue(config.aging_per_s)
        self.pool = WorkerPool(config, self)
        self.policy = make_policy(config)
        self.stats = RouterStats()
        self.draining = False
        self.num_active = 0  # admitted and not finished (queued or in flight)
        self._idle = asyncio.Event()
        self._idle.set()
        self._no_worker_since: float | None = time.monotonic()
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.pool.start()
        self._watchdog = asyncio.create_task(self._fail_queued_without_workers())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.pool.close()

    @property
    def has_healthy_worker(self) -> bool:
        return bool(self.pool.healthy())

    # --- admission ------------------------------------------------------------------------

    def admit(
        self, wire_request: pb.Request, outbox: asyncio.Queue[list[pb.Chunk]]
    ) -> RoutedRequest:
        """Queue a request; raises the typed error that refuses it."""
        if self.draining:
            raise UnavailableError("the router is draining and takes no new requests")
        parsed = wire.request_from_wire(wire_request)
        if not self.has_healthy_worker:
            raise UnavailableError("no healthy worker")
        num_tokens = _estimate_tokens(parsed.prompt)
        if (
            len(self.queue) >= self.config.max_queued_requests
            or self.queue.num_tokens + num_tokens > self.config.max_queued_tokens
        ):
            raise ResourceExhaustedError(
                f"the router's queue is full ({len(self.queue)} requests, "
                f"{self.queue.num_tokens} tokens)",
                retry_after_s=self.config.retry_after_s,
            )
        request = RoutedRequest(
            client_id=parsed.request_id,
            outbox=outbox,
            original=wire_request,
            parsed=parsed,
            arrival_s=time.monotonic(),
            num_tokens_estimate=num_tokens,
            affinity_key=self._affinity_key(parsed.prompt),
        )
        if parsed.timeout_s is not None:
            expired = DeadlineExceededError(f"timeout of {parsed.timeout_s:g} s passed")
            loop = asyncio.get_running_loop()
            request.timer = loop.call_later(parsed.timeout_s, self.fail, request, expired)
        self.num_active += 1
        self._idle.clear()
        self.queue.push(request, parsed.priority, request.arrival_s, num_tokens)
        self._dispatch()
        return request

    def _affinity_key(self, prompt: wire.Prompt) -> bytes:
        if isinstance(prompt, str):
            return prompt[: self.config.affinity_prefix_chars].encode()
        head = prompt[: self.config.affinity_prefix_tokens]
        return b"ids:" + b",".join(str(t).encode() for t in head)

    # --- dispatch -------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while (request := self.queue.peek()) is not None:
            candidates = [link for link in self.pool.links.values() if link.has_room(request)]
            if not candidates:
                return
            self.queue.pop()
            self.policy.choose(request, candidates).send(request)

    # --- events from worker links (LinkEvents) --------------------------------------------

    def on_response(self, link: WorkerLink, response: pb.GenerateResponse) -> None:
        by_outbox: dict[int, tuple[asyncio.Queue[list[pb.Chunk]], list[pb.Chunk]]] = {}
        finished = False
        for chunk in response.chunks:
            request = link.inflight.get(chunk.request_id)
            if request is None:
                continue  # cancelled or timed out here already
            if not request.first_token_s and chunk.token_ids:
                request.first_token_s = time.monotonic()
            out = request.to_client(chunk)
            if out.finished:
                link.forget(request)
                self._end(request)
                finished = True
            if not request.cancelled or out.finished:
                by_outbox.setdefault(id(request.outbox), (request.outbox, []))[1].append(out)
        for outbox, chunks in by_outbox.values():
            outbox.put_nowait(chunks)
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

    def _resume(self, request: RoutedRequest, link: WorkerLink) -> None:
        if request.done:
            return
        if request.cancelled:
            self._finish_locally(request, pb.FINISH_REASON_CANCELLED)
            return
        if request.parsed.config.n > 1:
            error = UnavailableError(
                f"worker {link.target} failed; requests with n > 1 are not resumed elsewhere"
            )
            self.fail(request, error)
            return
        if request.streamed_token_ids and request.remaining_tokens <= 0:
            self._finish_locally(request, pb.FINISH_REASON_LENGTH)
            return
        request.num_failovers += 1
        self.stats.num_failovers += 1
        logger.info("resuming request %s elsewhere", request.client_id)
        self.queue.push(
            request, request.parsed.priority, request.arrival_s, request.num_tokens_estimate
        )

    # --- ending requests --------------------------------------------------------------------

    def cancel(self, request: RoutedRequest) -> None:
        """The client cancelled: stop it wherever it is; its last chunk says CANCELLED."""
        if request.done or request.cancelled:
            return
        request.cancelled = True
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
        self._end(request)

    def fail(self, request: RoutedRequest, error: HeadraceError) -> None:
        """End a request with an in-band error (a timeout, an unresumable failover)."""
        if request.done:
            return
        self._stop(request)
        chunk = status.error_chunk(request.client_id, error)
        self._end(request)
        request.outbox.put_nowait([chunk])
        self._dispatch()

    def _finish_locally(self, request: RoutedRequest, reason: pb.FinishReason) -> None:
        usage = pb.Usage(generated_tokens=len(request.streamed_token_ids))
        if request.prompt_token_ids is not None:
            usage.prompt_tokens = len(request.prompt_token_ids)
        chunk = pb.Chunk(
            request_id=request.client_id, finish_reason=reason, finished=True, usage=usage
        )
        self._end(request)
        request.outbox.put_nowait([chunk])

    def _end(self, request: RoutedRequest) -> None:
        request.done = True
        if request.timer is not None:
            request.timer.cancel()
        if request.first_token_s:
            self.stats.ttft_s.append(request.first_token_s - request.arrival_s)
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    async def _fail_queued_without_workers(self) -> None:
        """Queued requests do not wait forever for workers that never come back."""
        while True:
            await asyncio.sleep(0.5)
            since = self._no_worker_since
            if since is None or time.monotonic() - since < self.config.unavailable_after_s:
                continue
            for request in self.queue.items():
                self.fail(request, UnavailableError("no healthy worker"))

    async def wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def model_info(self) -> pb.ModelInfo:
        for link in self.pool.healthy():
            stub = generation_pb2_grpc.GenerationStub(link.channel)
            try:
                info: pb.ModelInfo = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            except grpc.RpcError:
                continue
            return info
        raise UnavailableError("no healthy worker")


def _estimate_tokens(prompt: wire.Prompt) -> int:
    if isinstance(prompt, str):
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    return len(prompt)


@dataclass(slots=True)
class _Session:
    """The requests of one client stream."""

    router: Router
    outbox: asyncio.Queue[list[pb.Chunk]] = field(default_factory=asyncio.Queue)
    requests: dict[str, RoutedRequest] = field(default_factory=dict)
    input_done: bool = False

    def submit(self, wire_request: pb.Request) -> None:
        try:
            if wire_request.request_id in self.requests:
                raise InvalidArgumentError(
                    "request_id", f"{wire_request.request_id!r} is already in flight on this stream"
                )
            request = self.router.admit(wire_request, self.outbox)
        except HeadraceError as error:
            self.outbox.put_nowait([status.error_chunk(wire_request.request_id, error)])
            return
        self.requests[request.client_id] = request

    def cancel(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self.router.cancel(request)

    def wake(self) -> None:
        self.outbox.put_nowait([])

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        while not (self.input_done and not self.requests and self.outbox.empty()):
            chunks = await self.outbox.get()
            for chunk in chunks:
                if chunk.finished:
                    self.requests.pop(chunk.request_id, None)
            if chunks:
                yield pb.GenerateResponse(chunks=chunks)

    def close(self) -> None:
        for request in self.requests.values():
            self.router.abandon(request)
        self.requests.clear()


class RouterService(generation_pb2_grpc.GenerationServicer):
    """The same `Generation` service a worker serves, in front of many workers."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._sessions = itertools.count()

    # grpc.aio needs the handlers themselves to be async generators, hence the loops.
    async def Generate(
        self,
        request_iterator: AsyncIterator[pb.GenerateRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in serving.serve_stream(_Session(self.router), request_iterator):
            yield response

    async def GenerateOne(
        self, request: pb.Request, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        async for response in serving.serve_one(_Session(self.router), request, context):
            yield response

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        try:
            return await self.router.model_info()
        except HeadraceError as error:
            await status.abort(context, error)
