"""The worker's `WorkerControl` service, for the router: load reports and drain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc.aio
from headrace.protos import worker_pb2, worker_pb2_grpc
from headrace.sdk.weights import state_to_wire
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.serving.service import ServingState

DEFAULT_LOAD_INTERVAL_S = 1.0
MIN_LOAD_INTERVAL_S = 0.01
DEFAULT_DRAIN_GRACE_S = 30.0


class WorkerControlService(worker_pb2_grpc.WorkerControlServicer):
    def __init__(
        self,
        engine: AsyncEngine,
        state: ServingState,
        drain: Callable[[float], Awaitable[object]],
    ) -> None:
        self.engine = engine
        self.state = state
        self._drain = drain
        self._spec = engine.spec
        self._num_ranks = engine.num_ranks

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
            max_model_len=self._spec.max_model_len,
            admitted_requests=self.state.num_admitted,
            max_prompt_bytes=self._spec.max_prompt_bytes,
            weight_version=load.weight_version,
            state=state_to_wire(load.state),
            num_ranks=self._num_ranks,
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
