"""The router process: `headrace router --workers HOST:PORT,... --port 50051`.

It imports no torch: only grpc, protobuf and headrace's protos and SDK (and, for the
OpenAI-compatible door on ``--http-port``, Starlette and uvicorn on the same event loop).
Health is SERVING while at least one worker is healthy. SIGTERM / SIGINT drains like a
worker: NOT_SERVING, new requests refused with UNAVAILABLE (503 over HTTP), in-flight ones
finish within the grace period, then the servers stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

from headrace.protos import control_pb2, generation_pb2
from headrace.router.config import RouterConfig
from headrace.router.generation_control import RouterControlService
from headrace.router.http.app import HttpDoor
from headrace.router.http.server import HttpOptions, HttpServer
from headrace.router.router import Router
from headrace.router.service import RouterService
from headrace.sdk import serving
from headrace.sdk.serving import GENERATION_SERVICE

logger = logging.getLogger(__name__)

HEALTH_POLL_S = 0.1
GENERATION_DESCRIPTOR = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
CONTROL_DESCRIPTOR = control_pb2.DESCRIPTOR.services_by_name["GenerationControl"]


#: Where the router listens and how it stops.
RouterOptions = serving.ListenOptions


class RouterServer:
    def __init__(
        self, config: RouterConfig, options: RouterOptions, http: HttpOptions | None = None
    ) -> None:
        self.options = options
        self.http_options = http or HttpOptions()
        self.router = Router(config)
        services = [GENERATION_SERVICE, CONTROL_DESCRIPTOR.full_name]
        self.grpc = serving.Server(services, options.max_message_mib, options.security)
        service = RouterService(self.router, options.flow)
        serving.add_service(service, self.grpc.server, GENERATION_DESCRIPTOR)
        control = RouterControlService(self.router)  # fans out to every worker
        serving.add_service(control, self.grpc.server, CONTROL_DESCRIPTOR)
        self.http: HttpServer | None = None
        if self.http_options.port is not None:
            door = HttpDoor(
                self.router, options.flow, self.grpc.key_check, self.http_options.max_body_bytes
            )
            self.http = HttpServer(door.app, options.host, options.security.tls)
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self.router.start()
        if self.options.metrics_port is not None:
            registry = self.router.metrics.registry
            self.grpc.serve_metrics(
                registry, "router", self.options.host, self.options.metrics_port
            )
        port = await self.grpc.start(self.options.host, self.options.port)
        await self.grpc.set_serving(False)
        if self.http is not None and self.http_options.port is not None:
            await self.http.start(self.http_options.port)
        if self.options.health_port is not None:
            await self.grpc.serve_health(self.options.host, self.options.health_port)
        self._health_task = asyncio.create_task(self._follow_health())
        return port

    async def _follow_health(self) -> None:
        """SERVING while some worker is healthy and the router is not draining."""
        serving_now: bool | None = None
        while True:
            wanted = self.router.has_healthy_worker and not self.router.draining
            if wanted != serving_now:
                await self.grpc.set_serving(wanted)
                serving_now = wanted
            await asyncio.sleep(HEALTH_POLL_S)

    async def stop(self) -> None:
        start = time.monotonic()
        self.router.draining = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.grpc.set_serving(False)
        if not await self.router.active.wait_idle(self.options.grace_period_s):
            active = self.router.active.num_in_flight
            logger.warning("grace period over; cancelling %d requests", active)
        remaining_s = max(0.0, self.options.grace_period_s - (time.monotonic() - start))
        await self.grpc.stop(min(remaining_s, 1.0))
        if self.http is not None:
            await self.http.stop(min(remaining_s, 1.0))
        await self.router.close()


def run(config: RouterConfig, options: RouterOptions, http: HttpOptions | None = None) -> int:
    async def main() -> None:
        server = RouterServer(config, options, http)
        await serving.serve(
            "headrace-router",
            server.start,
            server.stop,
            lambda port: (
                f"headrace router serving {len(config.workers) or config.workers_dns} "
                f"workers on {options.host}:{port}"
            ),
        )

    asyncio.run(main())
    print("headrace router stopped", file=sys.stderr, flush=True)
    return 0
