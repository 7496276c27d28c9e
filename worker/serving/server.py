"""The worker process: `headrace worker --model NAME_OR_PATH --port 50051`.

Start-up loads the model (the engine's thread then runs the step loop), and only then binds
the port, so a worker that answers health checks can serve. Shutdown on SIGTERM / SIGINT runs
in the order gRPC's examples teach: health NOT_SERVING → refuse new requests → let in-flight
ones finish within the grace period → `server.stop` (cancels what is left) → engine shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from headrace.protos import control_pb2, generation_pb2, worker_pb2
from headrace.sdk import serving
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.serving import GENERATION_SERVICE
from headrace.sdk.tool_formats import TOOL_CALL_FORMATS
from headrace.worker.config import EngineConfig
from headrace.worker.engine.async_engine import AsyncEngine
from headrace.worker.execution.host_memory import quiet_collector
from headrace.worker.serving.generation_control import GenerationControlService
from headrace.worker.serving.metrics import WorkerMetrics
from headrace.worker.serving.service import GenerationService, ServingState, model_info
from headrace.worker.serving.worker_control import WorkerControlService

logger = logging.getLogger(__name__)

#: After a rank failure: how long the worker stays up to deliver NOT_SERVING to watchers.
FAILURE_FLUSH_S = 0.25
GENERATION_DESCRIPTOR = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
CONTROL_DESCRIPTOR = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"]
CONTROL_SERVICE = CONTROL_DESCRIPTOR.full_name
GENERATION_CONTROL_DESCRIPTOR = control_pb2.DESCRIPTOR.services_by_name["GenerationControl"]


@dataclass(frozen=True, slots=True)
class ServerOptions(serving.ListenOptions):
    #: The name clients put in `Request.model`; None means the --model argument as given.
    served_model_name: str | None = None
    #: The format the model writes tool calls in (a name in `TOOL_CALL_FORMATS`), reported in
    #: `ModelInfo.tool_call_parser`; None: read from the chat template.
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        serving.ListenOptions.__post_init__(self)  # slots: a new class, so no bare super()
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_FORMATS:
            raise InvalidArgumentError(
                "tool_call_parser",
                f"must be one of {', '.join(TOOL_CALL_FORMATS)}, got {self.tool_call_parser!r}",
            )


class WorkerServer:
    def __init__(self, engine: AsyncEngine, options: ServerOptions, model_name: str) -> None:
        self.engine = engine
        self.options = options
        self.state = ServingState()
        services = [GENERATION_SERVICE, CONTROL_SERVICE, GENERATION_CONTROL_DESCRIPTOR.full_name]
        self.grpc = serving.Server(services, options.max_message_mib, options.security)
        info = model_info(engine, model_name, options.tool_call_parser)
        self.metrics = WorkerMetrics(engine, model_name, self.state)
        generation = GenerationService(engine, info, self.state, self.metrics, options.flow)
        serving.add_service(generation, self.grpc.server, GENERATION_DESCRIPTOR)
        control = WorkerControlService(engine, self.state, self.drain)
        serving.add_service(control, self.grpc.server, CONTROL_DESCRIPTOR)
        rlhf = GenerationControlService(engine)
        serving.add_service(rlhf, self.grpc.server, GENERATION_CONTROL_DESCRIPTOR)
        self.port = 0

    async def start(self) -> int:
        """Bind and serve; returns the port (the picked one when options.port is 0)."""
        if self.options.metrics_port is not None:
            self.grpc.serve_metrics(
                self.metrics.registry, "worker", self.options.host, self.options.metrics_port
            )
        self.port = await self.grpc.start(self.options.host, self.options.port)
        await self.grpc.set_serving(True)
        if self.options.health_port is not None:
            await self.grpc.serve_health(self.options.host, self.options.health_port)
        self.engine.on_fatal(self._rank_failed(asyncio.get_running_loop()))
        return self.port

    def _rank_failed(self, loop: asyncio.AbstractEventLoop) -> Callable[[str], None]:
        """A callback for the rank supervisor: health NOT_SERVING before the process exits."""

        def mark_not_serving(reason: str) -> None:
            future = asyncio.run_coroutine_threadsafe(self.grpc.set_serving(False), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=1.0)
                time.sleep(FAILURE_FLUSH_S)  # let health watchers receive it before exit

        return mark_not_serving

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait for in-flight requests; True if they all finished."""
        if not self.state.draining:
            self.state.draining = True
            await self.grpc.set_serving(False)
            logger.info("draining: %d requests in flight", self.state.num_in_flight)
        return await self.state.wait_idle(grace_s)

    async def stop(self) -> None:
        """Drain within the grace period, then stop serving and stop the engine."""
        start = time.monotonic()
        drained = await self.drain(self.options.grace_period_s)
        if not drained:
            logger.warning("grace period over; cancelling %d requests", self.state.num_in_flight)
        remaining_s = max(0.0, self.options.grace_period_s - (time.monotonic() - start))
        await self.grpc.stop(min(remaining_s, 1.0))
        await asyncio.to_thread(self.engine.shutdown)


def run(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Load the model, serve until SIGTERM / SIGINT, drain, and return the exit code (0)."""
    engine = AsyncEngine(engine_config)
    quiet_collector()
    model_name = options.served_model_name or engine_config.model

    async def main() -> None:
        server = WorkerServer(engine, options, model_name)
        await serving.serve(
            "headrace-worker",
            server.start,
            server.stop,
            lambda port: f"headrace worker serving {model_name} on {options.host}:{port}",
        )

    try:
        asyncio.run(main())
    except BaseException:
        engine.shutdown()
        raise
    print("headrace worker stopped", file=sys.stderr, flush=True)
    return 0
