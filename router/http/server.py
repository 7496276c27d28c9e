"""The HTTP door's listener: uvicorn, on the router's own event loop.

The router's state has no locks because everything runs on one asyncio loop; the door's
handlers must run there too, so uvicorn is started as a server on that loop (`startup` /
`shutdown`, never `uvicorn.run`, which would own the loop and the signals: the router's
drain handles SIGTERM). The socket is bound here, so a taken port fails at start and port 0
picks a free one, printed as ``http on HOST:PORT``. With the router's TLS flags the door
serves HTTPS with the same files (mTLS too); unlike the gRPC port it reads them once, at
start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import ssl
from dataclasses import dataclass

import uvicorn
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.tls import ServerTls
from starlette.types import ASGIApp

logger = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """The OpenAI-compatible HTTP door of the router."""

    #: Port to serve on (same host as gRPC); None: no HTTP door, 0: a free port.
    port: int | None = None
    #: Largest request body; a bigger one is answered 413 before it is parsed.
    max_body_mib: int = 16

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise InvalidArgumentError("http_port", f"must be in [0, 65535], got {self.port}")
        if self.max_body_mib < 1:
            raise InvalidArgumentError("max_body_mib", "must be >= 1")

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mib * MIB


class HttpServer:
    def __init__(self, app: ASGIApp, host: str, tls: ServerTls | None) -> None:
        self.host = host
        self.config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,  # the router's logging, as configured
            access_log=False,  # the router logs one line per request already
            server_header=False,
            ssl_certfile=str(tls.cert_file) if tls else None,
            ssl_keyfile=str(tls.key_file) if tls else None,
            # mTLS: a client without a certificate this CA signed fails the handshake.
            ssl_ca_certs=str(tls.client_ca_file) if tls and tls.client_ca_file else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE,
        )
        self.server = uvicorn.Server(self.config)
        self._ticker: asyncio.Task[None] | None = None

    async def start(self, port: int) -> int:
        """Bind and serve; returns the port (the picked one when port is 0)."""
        sock = _bind(self.host, port)
        self.config.load()
        # What `uvicorn.Server.serve` does before `startup`, minus taking over the signals.
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[sock])
        # The ticker refreshes the Date header each second and notices `should_exit`.
        self._ticker = asyncio.create_task(self.server.main_loop())
        bound: int = sock.getsockname()[1]
        # Scripts (and tests) started with port 0 read the port from this line.
        print(f"http on {self.host}:{bound}", flush=True)
        return bound

    async def stop(self, grace_s: float) -> None:
        """Stop listening, close idle connections, give open ones ``grace_s`` to finish."""
        if self._ticker is None:
            return
        self.server.should_exit = True
        await self._ticker
        self.config.timeout_graceful_shutdown = max(1, math.ceil(grace_s))
        await self.server.shutdown()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Protocol IPPROTO_TCP, as asyncio's own listening sockets have: only then does asyncio
    # set TCP_NODELAY on each connection. Without it, an SSE event written while the
    # client's ACK of the previous one is delayed waits for it (40 ms on Linux).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as error:
        sock.close()
        raise InvalidArgumentError(
            "http_port", f"could not listen on {host}:{port}: {error.strerror or error}"
        ) from None
    return sock
