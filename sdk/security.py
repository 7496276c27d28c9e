"""How a headrace server guards its door: TLS and API keys, built once from the flags.

    headrace worker ... --tls-cert server.pem --tls-key server.key  # TLS
                        --tls-client-ca clients-ca.pem               # mTLS: client certificates
                        --api-key-file keys.txt                      # keys (sdk/api_keys.py)
                        --health-port 8081                           # plaintext health, for probes

Defaults stay open: with none of these flags a server listens in plaintext and asks for no
key, as before, so `make run` stays one command. A server that listens beyond loopback with
neither API keys nor client certificates says so in one warning line at start. TLS covers
the gRPC port; Prometheus metrics stay plain on their own (private) port, and so does the
optional health port: Kubernetes' gRPC probes speak no TLS, so a TLS server offers its
`grpc.health.v1` alone there.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from headrace.sdk.api_keys import ApiKeys
from headrace.sdk.auth import ApiKeyInterceptor
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.tls import ServerTls

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """TLS on the listener (None: plaintext) and the API keys it accepts (None: any caller)."""

    tls: ServerTls | None = None
    api_keys: ApiKeys | None = None

    @property
    def authenticates_callers(self) -> bool:
        """Whether a caller must prove who it is (a key, or a client certificate)."""
        return self.api_keys is not None or (
            self.tls is not None and self.tls.requires_client_certificate
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.api_keys is None else [ApiKeyInterceptor(self.api_keys)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on ``address`` (TLS or plaintext); the port bound, 0 if binding failed."""
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.credentials())

    def warn_if_open(self, host: str, port: int) -> None:
        """One warning line when anyone who reaches a non-loopback address may call."""
        if is_loopback(host) or self.authenticates_callers:
            return
        logger.warning(
            "listening on %s:%d without API keys or client certificates: anyone who can "
            "reach it may generate and drain (give --api-key-file or --tls-client-ca)",
            host,
            port,
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def add_server_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `server_security`, for every server (worker, router)."""
    add = parser.add_argument
    add("--tls-cert", metavar="PEM", help="serve TLS with this certificate (re-read on change)")
    add("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    add("--tls-client-ca", metavar="PEM", help="mTLS: clients need a certificate this CA signed")
    add(
        "--api-key-file",
        metavar="FILE",
        help="accept only these keys (one per line; see docs/security.md)",
    )
    add(
        "--health-port",
        type=int,
        metavar="PORT",
        help="also serve grpc.health.v1 alone, in plaintext, here",
    )


def server_security(args: argparse.Namespace) -> ServerSecurity:
    """`ServerSecurity` from the flags; files are read and checked now, once."""
    tls = None
    if args.tls_cert or args.tls_key or args.tls_client_ca:
        if not (args.tls_cert and args.tls_key):
            message = "--tls-cert and --tls-key go together (--tls-client-ca needs both)"
            raise InvalidArgumentError("tls_cert", message)
        client_ca = Path(args.tls_client_ca) if args.tls_client_ca else None
        tls = ServerTls(Path(args.tls_cert), Path(args.tls_key), client_ca)
    api_keys = ApiKeys.load(args.api_key_file) if args.api_key_file else None
    return ServerSecurity(tls, api_keys)
