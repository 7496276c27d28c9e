"""The worker process: `headrace worker --model NAME_OR_PATH --port 50051`.

Start-up loads the model (the engine's thread then runs the step loop), and only then binds
the port, so a worker that answers health checks can serve. Shutdown on SIGTERM / SIGINT runs
in the order gRPC's examples teach: health NOT_SERVING → refuse new requests → let in-flight
ones finish within the grace period → `server.stop` (cancels what is left) → engine shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.async_engine import AsyncEngine
from headrace.worker.config import EngineConfig
from headrace.worker.service import (
    GenerationService,
    ServingState,
    WorkerControlService,
    model_info,
)

logger = logging.getLogger(__name__)

GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
CONTROL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name
MIB = 2**20


@dataclass(frozen=True, slots=True)
class ServerOptions:
    #: Address to listen on; "0.0.0.0" serves every interface (what a pod needs).
    host: str = "0.0.0.0"
    #: 0 picks a free port (printed at start).
    port: int = 50051
    #: The name clients put in `Request.model`; None means the --model argument as given.
    served_model_name: str | None = None
    #: On SIGTERM, how long in-flight requests get to finish before they are cancelled.
    grace_period_s: float = 30.0
    #: Largest message accepted or sent. Prompts as token ids are the big ones: 1M tokens
    #: take about 5 MiB.
    max_message_mib: int = 16

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError("port", f"must be in [0, 65535], got {self.port}")
        if self.grace_period_s < 0:
            raise InvalidArgumentError("grace_period_s", "must be >= 0")
        if self.max_message_mib < 1:
            raise InvalidArgumentError("max_message_mib", "must be >= 1")


def channel_options(max_message_mib: int) -> list[tuple[str, Any]]:
    """gRPC settings of the worker's server; each one's reason beside it."""
    return [
        # Prompts can be long token-id lists and one step's response carries every request
        # of a stream; the 4 MiB default is too tight for either.
        ("grpc.max_receive_message_length", max_message_mib * MIB),
        ("grpc.max_send_message_length", max_message_mib * MIB),
        # Ping idle connections every 20 s and drop them if no answer comes within 10 s:
        # a client that vanished (host gone, no FIN) must not hold KV blocks for long.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Clients (the router, the SDK) ping too, to notice a dead worker during long
        # generations with no output yet; accept pings every 5 s even without calls, rather
        # than answering GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class WorkerServer:
    def __init__(self, engine: AsyncEngine, options: ServerOptions, model_name: str) -> None:
        self.engine = engine
        self.options = options
        self.state = ServingState()
        self.health = HealthServicer()
        self.server = grpc.aio.server(options=channel_options(options.max_message_mib))
        info = model_info(engine, model_name)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationService(engine, info, self.state), self.server
        )
        worker_pb2_grpc.add_WorkerControlServicer_to_server(
            WorkerControlService(engine, self.state, self.drain, info.max_model_len), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = (
            GENERATION_SERVICE,
            CONTROL_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(services, self.server)
        self.port = 0

    async def start(self) -> int:
        """Bind and serve; returns the port (the picked one when options.port is 0)."""
        address = f"{self.options.host}:{self.options.port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind {address}")
        await self.server.start()
        for service in ("", GENERATION_SERVICE, CONTROL_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work and wait for in-flight requests; True if they all finished."""
        if not self.state.draining:
            self.state.draining = True
            for service in ("", GENERATION_SERVICE, CONTROL_SERVICE):
                await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
            logger.info("draining: %d requests in flight", self.state.num_in_flight)
        return await self.state.wait_idle(grace_s)

    async def stop(self) -> None:
        """Drain within the grace period, then stop serving and stop the engine."""
        start = time.monotonic()
        drained = await self.drain(self.options.grace_period_s)
        if not drained:
            logger.warning("grace period over; cancelling %d requests", self.state.num_in_flight)
        remaining_s = max(0.0, self.options.grace_period_s - (time.monotonic() - start))
        await self.server.stop(grace=min(remaining_s, 1.0))
        await asyncio.to_thread(self.engine.shutdown)

    async def serve_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        logger.info("signal received; shutting down")
        await self.stop()


def run(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Load the model, serve until SIGTERM / SIGINT, drain, and return the exit code (0)."""
    engine = AsyncEngine(engine_config)
    model_name = options.served_model_name or engine_config.model

    async def main() -> None:
        server = WorkerServer(engine, options, model_name)
        port = await server.start()
        # One line on stdout that scripts (and tests) read to find the port.
        print(f"headrace worker serving {model_name} on {options.host}:{port}", flush=True)
        await server.serve_until_signal()

    try:
        asyncio.run(main())
    except BaseException:
        engine.shutdown()
        raise
    print("headrace worker stopped", file=sys.stderr, flush=True)
    return 0
