"""What every headrace server (router, worker) shares: channel settings, health, reflection,
and the signal-driven shutdown. Imported by servers only (it needs the `router` or `worker`
extra for grpcio-health-checking and grpcio-reflection).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from headrace.protos import generation_pb2
from headrace.sdk import status, tracing
from headrace.sdk.auth import ApiKeyInterceptor
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.security import ServerSecurity
from headrace.sdk.streams import FlowLimits, Undecodable
from headrace.sdk.telemetry import MetricsServer, RuntimeCollector
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

MIB = 2**20
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(frozen=True, slots=True)
class ListenOptions:
    """Where and how a server listens, and how it stops."""

    #: Address to listen on; "0.0.0.0" serves every interface (what a pod needs).
    host: str = "0.0.0.0"
    #: 0 picks a free port (printed at start).
    port: int = 50051
    #: On SIGTERM, how long in-flight requests get to finish before they are cancelled.
    grace_period_s: float = 30.0
    #: Largest message accepted or sent. Prompts as token ids are the big ones: 1M tokens
    #: take about 5 MiB.
    max_message_mib: int = 16
    #: Port of the Prometheus ``/metrics`` endpoint (same host); None: no endpoint, 0: a
    #: free port (printed at start).
    metrics_port: int | None = None
    #: Flow control of each stream: how far a reader may fall behind before its requests are
    #: held, and how long they are held before they fail (see `headrace.sdk.streams`).
    flow: FlowLimits = field(default_factory=FlowLimits)
    #: TLS and API keys of the gRPC port (default: plaintext, no keys).
    security: ServerSecurity = field(default_factory=ServerSecurity)
    #: A plaintext port serving `grpc.health.v1` alone, for probes that speak no TLS (same
    #: host); None: none, 0: a free port (printed at start).
    health_port: int | None = None

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port", "health_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise InvalidArgumentError(name, f"must be in [0, 65535], got {port}")
        if self.grace_period_s < 0:
            raise InvalidArgumentError("grace_period_s", "must be >= 0")
        if self.max_message_mib < 1:
            raise InvalidArgumentError("max_message_mib", "must be >= 1")


def channel_options(max_message_mib: int) -> list[tuple[str, Any]]:
    """gRPC settings of headrace's servers; each one's reason beside it."""
    return [
        # Prompts can be long token-id lists and one step's response carries every request
        # of a stream; the 4 MiB default is too tight for either.
        ("grpc.max_receive_message_length", max_message_mib * MIB),
        ("grpc.max_send_message_length", max_message_mib * MIB),
        # Ping idle connections every 20 s and drop them if no answer comes within 10 s:
        # a client that vanished (host gone, no FIN) must not hold KV blocks for long.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Clients (the router, the SDK) ping too, to notice a dead server during long
        # generations with no output yet; accept pings every 5 s even without calls, rather
        # than answering GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC sets SO_REUSEPORT by default, so a second server on a taken port would start
        # and silently take a share of the connections: binding must fail instead.
        ("grpc.so_reuseport", 0),
    ]


class Server:
    """A grpc.aio server with health and reflection for the given services, and optionally
    a Prometheus ``/metrics`` endpoint beside it."""

    def __init__(
        self, services: list[str], max_message_mib: int, security: ServerSecurity | None = None
    ) -> None:
        self.services = services
        self.security = security or ServerSecurity()
        interceptors = self.security.interceptors()
        #: The API-key check of this port (None: no keys); the router's HTTP door asks it
        #: too, so a key's limits count its requests through both.
        self.key_check = next((i for i in interceptors if isinstance(i, ApiKeyInterceptor)), None)
        self.server = grpc.aio.server(
            options=channel_options(max_message_mib), interceptors=interceptors
        )
        self.metrics_server: MetricsServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            *services,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the port (the picked one when port is 0)."""
        address = f"{host}:{port}"
        try:
            bound = self.security.add_port(self.server, address)
        except RuntimeError:  # gRPC raises where it cannot bind, on some versions
            bound = 0
        if bound == 0:
            raise InvalidArgumentError(
                "port", f"could not listen on {address}: the address is in use or not available"
            )
        await self.server.start()
        self.security.warn_if_open(host, bound)
        return bound

    async def serve_health(self, host: str, port: int) -> int:
        """Serve this server's `grpc.health.v1` alone, in plaintext, on host:port; returns the
        port (picked if 0). For probes that speak no TLS (Kubernetes' gRPC probes)."""
        self.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        bound = self.health_server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await self.health_server.start()
        # Scripts (and tests) started with port 0 read the port from this line.
        print(f"health on {host}:{bound}", flush=True)
        return bound

    def serve_metrics(
        self, registry: CollectorRegistry, subsystem: str, host: str, port: int
    ) -> int:
        """Serve ``registry`` (plus the process's tasks and threads, named for
        ``subsystem``) at http://host:port/metrics; returns the port (picked if 0). Call it
        on the server's event loop."""
        registry.register(RuntimeCollector(subsystem, asyncio.get_running_loop()))
        self.metrics_server = MetricsServer(registry, host, port)
        # Scripts (and tests) started with port 0 read the port from this line.
        print(f"metrics on http://{host}:{self.metrics_server.port}/metrics", flush=True)
        return self.metrics_server.port

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace=grace_s)
        if self.health_server is not None:
            await self.health_server.stop(None)
        if self.metrics_server is not None:
            self.metrics_server.close()

    async def set_serving(self, serving: bool) -> None:
        """Health of the server ("") and of each of its services."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", *self.services):
            await self.health.set(service, status)


async def wait_for_signal() -> None:
    """Return once SIGTERM or SIGINT arrives."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    logger.info("signal received; shutting down")


async def serve(
    service_name: str,
    start: Callable[[], Awaitable[int]],
    stop: Callable[[], Awaitable[None]],
    banner: Callable[[int], str],
) -> None:
    """Set up tracing (`OTEL_*`), start, print the banner line (scripts read the port from
    it), run until a signal, stop, and flush the spans."""
    provider = tracing.configure_tracing(service_name)
    try:
        port = await start()
        print(banner(port), flush=True)
        await wait_for_signal()
        await stop()
    finally:
        if provider is not None:
            provider.shutdown()


class InFlight:
    """How many requests a server holds (admitted, not finished), and a wait for none.

    Router and worker both drain with it: refuse new work, then `wait_idle(grace)`.
    """

    def __init__(self) -> None:
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def started(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def ended(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if timeout_s passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


def add_service(servicer: object, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    """Register ``servicer``'s methods for ``service``, with request parsing that never
    raises: bytes that are not the request message reach the handler as `Undecodable`, so a
    garbage message gets INVALID_ARGUMENT (not UNKNOWN and a traceback). Stream handlers see
    it in their request iterator; unary ones are answered here."""
    handlers = {}
    for method in service.methods:
        behaviour = getattr(servicer, method.name)
        if not method.client_streaming:
            behaviour = _refusing_undecodable(behaviour)
        make = _HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            behaviour,
            request_deserializer=_tolerant_parser(method.input_type),
            response_serializer=_serialize,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )


_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _tolerant_parser(descriptor: Descriptor) -> Callable[[bytes], Message | Undecodable]:
    message_class = message_factory.GetMessageClass(descriptor)

    def parse(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return Undecodable(descriptor.full_name, str(error))

    return parse


def _refusing_undecodable(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A unary-request handler (a coroutine, or an async generator of responses) that
    answers an undecodable request with INVALID_ARGUMENT."""

    async def refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> NoReturn:
        logger.warning("refusing a call: %s", request.fault())
        await status.abort(context, request.fault())

    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await refuse(request, context)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await refuse(request, context)
        return await behaviour(request, context)

    return unary


def wait_serving(target: str, timeout_s: float = 60.0) -> bool:
    """Poll grpc.health.v1 until the server says SERVING; False if timeout_s passed first.

    UNAVAILABLE (nothing listening yet, or a proxy with no healthy upstream yet) is retried.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            else:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            time.sleep(0.05)
    return False
