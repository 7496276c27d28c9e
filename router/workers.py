"""The router's side of each worker: a load-report stream, one multiplexed `Generate` stream,
and the requests in flight on it.

Design note. A `WorkerLink` is healthy while its `WatchLoad` stream delivers reports; the
first report opens the `Generate` stream, and the link is in rotation from then on. Any of
these ends it: the load stream breaks or falls silent for `unhealthy_after_s`, or the
`Generate` stream breaks. Then every request in flight on the link is handed back to the
router (which resumes them elsewhere), and the link retries with backoff until the worker
answers again. Between two reports the link counts what it sent itself, so a burst of
dispatches does not all land on the worker that looked idlest a report ago.

Every call to the worker carries the router's API key (`RouterConfig.worker_security`); the
channel speaks TLS when configured, and is made again from the certificate files when they
changed while the worker was away (a rotated CA or client certificate takes effect at the
next connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
import grpc.aio
from headrace.protos import (
    control_pb2,
    control_pb2_grpc,
    generation_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from headrace.protos import generation_pb2 as pb
from headrace.router.config import RouterConfig
from headrace.router.request import RoutedRequest
from headrace.sdk.client import CHANNEL_OPTIONS
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.status import duration

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0


class LinkEvents(Protocol):
    """What a link tells the router."""

    def on_response(self, link: WorkerLink, response: pb.GenerateResponse) -> None: ...
    def on_down(self, link: WorkerLink, orphans: list[RoutedRequest]) -> None: ...
    def on_change(self) -> None: ...


class WorkerLink:
    def __init__(self, target: str, config: RouterConfig, events: LinkEvents) -> None:
        self.target = target
        self.config = config
        self.events = events
        #: Call metadata for the worker (the router's API key, if any).
        self.metadata = config.worker_security.metadata
        self._connect()
        self.healthy = False
        self.report: worker_pb2.LoadReport | None = None
        #: Its last report said draining: it will not take work again (until a report says
        #: otherwise), even after its connection goes.
        self.leaving = False
        self.inflight: dict[str, RoutedRequest] = {}
        #: Sent since the last report (the report does not know them yet).
        self._sent_tokens = 0
        self._sent_blocks = 0
        self._outgoing: asyncio.Queue[pb.GenerateRequest | None] | None = None
        self._stream: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._wire_ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def _connect(self) -> None:
        """A channel (TLS or not) from the certificate files as they are now."""
        security = self.config.worker_security
        files_signature = security.signature()
        self.channel = security.channel(self.target, _LINK_OPTIONS)
        self._files_signature = files_signature
        self._generation = generation_pb2_grpc.GenerationStub(self.channel)
        self._control = worker_pb2_grpc.WorkerControlStub(self.channel)
        #: The worker's `GenerationControl` (the router's own fans out to it).
        self.generation_control = control_pb2_grpc.GenerationControlStub(self.channel)

    async def _reconnect_if_rotated(self) -> None:
        """While the worker is away: if a certificate file changed, a new channel uses it."""
        if self.config.worker_security.signature() == self._files_signature:
            return
        old = self.channel
        try:
            self._connect()
        except InvalidArgumentError as error:  # caught mid-write: try again at the next retry
            logger.warning("worker %s: keeping the current channel: %s", self.target, error)
            return
        logger.info("worker %s: certificate files changed; new channel", self.target)
        await old.close()

    # --- capacity, as the policies see it --------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self.inflight)

    @property
    def queued_tokens(self) -> int:
        return (self.report.queued_tokens if self.report else 0) + self._sent_tokens

    @property
    def free_kv_blocks(self) -> int:
        return (self.report.free_kv_blocks if self.report else 0) - self._sent_blocks

    @property
    def accepting(self) -> bool:
        """In rotation: up, not draining, not asleep (a paused worker is: it resumes)."""
        report = self.report
        return (
            self.healthy
            and report is not None
            and not report.draining
            and report.state not in _OUT_OF_ROTATION
        )

    @property
    def weight_version(self) -> str:
        return self.report.weight_version if self.report is not None else ""

    def note_state(self, state: control_pb2.WorkerState) -> None:
        """The worker's answer to a control call: its state and version, until the next
        load report."""
        if self.report is None:
            return
        report = worker_pb2.LoadReport()
        report.CopyFrom(self.report)
        report.state, report.weight_version = state.state, state.weight_version
        self.report = report

    def has_room(self, request: RoutedRequest) -> bool:
        """Whether ``request`` may go here now: generating (not paused), under the in-flight
        cap, KV room by the estimates, and serving the weights its tokens so far came from
        (after a failover). Over the cap (up to twice it) a request still goes where
        something of lower priority is in flight: the worker serves it first (preempting at
        its own sequence cap), so holding it back here would only delay it."""
        if not self.accepting:
            return False
        cap = self.config.max_inflight_per_worker
        if self.num_inflight >= cap and not (
            self.num_inflight < 2 * cap and self._outranks_one_in_flight(request)
        ):
            return False
        assert self.report is not None
        if self.report.state != control_pb2.GENERATION_STATE_SERVING:
            return False  # paused: the request waits in the router's queue
        if request.required_version and request.required_version != self.weight_version:
            return False
        return self.free_kv_blocks >= self._blocks_for(request) or not self.inflight

    def _outranks_one_in_flight(self, request: RoutedRequest) -> bool:
        priority = request.parsed.priority
        return priority > min((r.parsed.priority for r in self.inflight.values()), default=priority)

    def _blocks_for(self, request: RoutedRequest) -> int:
        """KV blocks the request may take here: its estimate, but never more than one
        sequence can hold (so an overestimated text prompt cannot wait forever for room)."""
        num_tokens = request.num_tokens_estimate + 1
        block_size = 16
        if self.report is not None:
            block_size = max(1, self.report.block_size)
            num_tokens = min(num_tokens, self.report.max_model_len or num_tokens)
        return -(-num_tokens // block_size)

    # --- requests -----------------------------------------------------------------------

    def send(self, request: RoutedRequest) -> None:
        assert self._outgoing is not None and self.healthy
        wire_id = f"{next(self._wire_ids)}"
        request.dispatched_to(self, wire_id)
        self.inflight[wire_id] = request
        self._sent_tokens += request.num_tokens_estimate
        self._sent_blocks += self._blocks_for(request)
        self._outgoing.put_nowait(pb.GenerateRequest(request=request.for_worker(wire_id)))
        if request.held:
            self.hold(request)

    def hold(self, request: RoutedRequest) -> None:
        """Hold the request on the worker (a `Pause`): its client reads too slowly."""
        pause = pb.Pause(request_ids=[request.wire_id])
        self._tell(request, pb.GenerateRequest(pause=pause))

    def release(self, request: RoutedRequest) -> None:
        """Let the worker go on with a held request (a `Resume`)."""
        resume = pb.Resume(request_ids=[request.wire_id])
        self._tell(request, pb.GenerateRequest(resume=resume))

    def cancel(self, request: RoutedRequest) -> None:
        """Ask the worker to stop a request (its last chunk still comes back)."""
        self._tell(request, pb.GenerateRequest(cancel=pb.Cancel(request_id=request.wire_id)))

    def _tell(self, request: RoutedRequest, message: pb.GenerateRequest) -> None:
        """Send a message about a request, if it runs on this link's open stream."""
        if self._outgoing is not None and request.wire_id in self.inflight:
            self._outgoing.put_nowait(message)

    def forget(self, request: RoutedRequest) -> None:
        """Stop routing the request's chunks (cancel it first if it may still run)."""
        self.inflight.pop(request.wire_id, None)

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"link {self.target}")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._down("closed")
        await self.channel.close()

    async def _run(self) -> None:
        backoff_s = 0.1
        refused = False  # said once, not at every retry
        while not self._closing:
            try:
                await self._watch_load()
                reason = "load stream ended"
            except grpc.RpcError as error:
                reason = f"load stream failed: {error.code().name}"
                if error.code() in _REFUSED and not refused:  # --worker-api-key-file is wrong
                    logger.error("worker %s refused the router: %s", self.target, error.details())
                refused = error.code() in _REFUSED
            except TimeoutError:
                reason = f"no load report for {self.config.unhealthy_after_s:g} s"
            was_healthy = self.healthy
            self._down(reason)
            await self._reconnect_if_rotated()
            backoff_s = 0.1 if was_healthy else min(MAX_BACKOFF_S, backoff_s * 2)
            await asyncio.sleep(backoff_s)

    async def _watch_load(self) -> None:
        # Wait for the channel itself: a call made while it is between reconnect attempts
        # would fail at once, and the link's backoff would then add to gRPC's.
        await self.channel.channel_ready()
        interval = duration(self.config.load_interval_s)
        request = worker_pb2.WatchLoadRequest(interval=interval)
        call = self._control.WatchLoad(request, metadata=self.metadata)
        try:
            reports = call.__aiter__()
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancel that lands as a report arrives, and the link would never close.
                async with asyncio.timeout(self.config.unhealthy_after_s):
                    report = await reports.__anext__()
                self._on_report(report)
        except StopAsyncIteration:
            return
        finally:
            call.cancel()

    def _on_report(self, report: worker_pb2.LoadReport) -> None:
        if report.draining and not self.leaving:
            logger.info("worker %s is draining: out of rotation", self.target)
        self.report = report
        self.leaving = report.draining
        self._sent_tokens = self._sent_blocks = 0
        if not self.healthy:
            self._open_stream()
            self.healthy = True
            logger.info("worker %s is up", self.target)
        self.events.on_change()

    def _open_stream(self) -> None:
        outgoing: asyncio.Queue[pb.GenerateRequest | None] = asyncio.Queue()
        self._outgoing = outgoing
        self._stream = self._generation.Generate(_drain(outgoing), metadata=self.metadata)
        self._reader = asyncio.create_task(self._read(self._stream))

    async def _read(self, stream: Any) -> None:
        try:
            async for response in stream:
                self.events.on_response(self, response)
            reason = "generate stream ended"
        except grpc.RpcError as error:
            reason = f"generate stream failed: {error.code().name}"
        except asyncio.CancelledError:
            return
        if stream is self._stream:
            self._down(reason)

    def _down(self, reason: str) -> None:
        """Out of rotation; hand the requests in flight back to the router."""
        if self.healthy:
            logger.warning("worker %s is down: %s", self.target, reason)
        self.healthy = False
        self.report = None
        if self._outgoing is not None:
            self._outgoing.put_nowait(None)
            self._outgoing = None
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        orphans = list(self.inflight.values())
        self.inflight.clear()
        for request in orphans:
            request.left_worker()
        self.events.on_down(self, orphans)
        self.events.on_change()


async def _drain(outgoing: asyncio.Queue[pb.GenerateRequest | None]) -> AsyncIterator[Any]:
    while (message := await outgoing.get()) is not None:
        yield message


#: Worker states that take a worker out of rotation (requests are refused, not queued).
_OUT_OF_ROTATION = (
    control_pb2.GENERATION_STATE_ASLEEP,
    control_pb2.GENERATION_STATE_WEIGHTS_INCOMPLETE,
)

#: A worker's answers that mean it does not accept the router's key.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

#: The router's channel to a worker: the SDK's settings, pinging every 10 s so a worker that
#: vanished without closing its connection is noticed even between load reports, and
#: reconnecting at least every 2 s (gRPC's own backoff grows to 2 minutes, and jitters by
#: 20%), so a worker that restarts is back in rotation within 2.4 s plus a handshake.
_LINK_OPTIONS = [
    *[(key, value) for key, value in CHANNEL_OPTIONS if key != "grpc.keepalive_time_ms"],
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(MAX_BACKOFF_S * 1000)),
]


class WorkerPool:
    """The links, from a static list or a DNS name that is resolved again and again."""

    def __init__(self, config: RouterConfig, events: LinkEvents) -> None:
        self.config = config
        self.events = events
        self.links: dict[str, WorkerLink] = {}
        self._resolver: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.workers_dns:
            self._resolver = asyncio.create_task(self._resolve_forever(self.config.workers_dns))
        for target in self.config.workers:
            self._add(target)

    def _add(self, target: str) -> None:
        link = WorkerLink(target, self.config, self.events)
        self.links[target] = link
        link.start()

    async def _resolve_forever(self, name_port: str) -> None:
        name, _, port = name_port.rpartition(":")
        while True:
            try:
                targets = await _resolve(name, int(port))
            except OSError as error:
                logger.warning("cannot resolve %s: %s", name, error)
                targets = set(self.links)  # keep what we have
            for target in targets - set(self.links):
                self._add(target)
            for target in set(self.links) - targets:
                await self.links.pop(target).close()
            await asyncio.sleep(self.config.dns_refresh_s)

    def accepting(self) -> list[WorkerLink]:
        """The links in rotation: up and not draining."""
        return [link for link in self.links.values() if link.accepting]

    def all_leaving(self) -> bool:
        """Every worker is draining (or went down draining): none will take work soon."""
        return bool(self.links) and all(link.leaving for link in self.links.values())

    async def close(self) -> None:
        if self._resolver is not None:
            self._resolver.cancel()
        for link in list(self.links.values()):
            await link.close()


async def _resolve(name: str, port: int) -> set[str]:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    targets = set()
    for family, _, _, _, address in infos:
        host = f"[{address[0]}]" if family == socket.AF_INET6 else str(address[0])
        targets.add(f"{host}:{port}")
    return targets
