"""What the security tests run with: a real PKI made on the fly (`tests/certs.py`), key files,
and a worker and a router started with TLS, mTLS and API keys.

    worker: TLS (its own certificate), mTLS (clients need a certificate from the CA),
            keys: ROUTER_KEY (plain), OPS_KEY (admin), LIMITED_KEY
    router: TLS, keys: CLIENT_KEY (max_priority=5 max_concurrency=2), OPS_KEY (admin);
            to the worker: the CA, its own client certificate, ROUTER_KEY
"""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from headrace.sdk.client import Client

from tests.certs import CertificateAuthority, Issued

ROUTER_KEY = "router-to-worker-0123456789abcdef"
OPS_KEY = "ops-admin-0123456789abcdef"
CLIENT_KEY = "client-0123456789abcdef"
LIMITED_KEY = "limited-0123456789abcdef"
CEILING = 5
MAX_CONCURRENCY = 2


@dataclass(frozen=True)
class Pki:
    """Every certificate and key file of the tests, in one folder."""

    folder: Path
    ca: CertificateAuthority
    worker: Issued
    router: Issued
    #: The router's client certificate for its workers (mTLS).
    router_client: Issued
    #: A client certificate for tests that call the worker directly.
    tester: Issued
    #: Signed by another CA: a worker must refuse it.
    stranger: Issued

    @classmethod
    def make(cls, folder: Path) -> Pki:
        ca = CertificateAuthority(folder, "headrace-test-ca")
        stranger = CertificateAuthority(folder / "other", "other-ca").client("stranger")
        return cls(
            folder,
            ca,
            worker=ca.server("worker"),
            # Also the Service's name, which Envoy (deploy/envoy) checks.
            router=ca.server("router", ("localhost", "127.0.0.1", "headrace-router")),
            router_client=ca.client("router-client"),
            tester=ca.client("tester"),
            stranger=stranger,
        )

    def write(self, name: str, text: str) -> Path:
        path = self.folder / name
        path.write_text(text)
        return path

    def worker_args(self) -> list[str]:
        keys = self.write(
            "worker-keys.txt",
            f"{ROUTER_KEY} name=router\n{OPS_KEY} name=ops admin\n"
            f"{LIMITED_KEY} name=limited max_priority={CEILING}\n",
        )
        return [
            "--tls-cert", str(self.worker.cert), "--tls-key", str(self.worker.key),
            "--tls-client-ca", str(self.ca.cert), "--api-key-file", str(keys),
            "--health-port", "0",
        ]  # fmt: skip

    def router_args(
        self, worker_key: str | None = ROUTER_KEY, client_cert: bool = True
    ) -> list[str]:
        keys = self.write(
            "router-keys.txt",
            f"# clients\n{CLIENT_KEY} name=client max_priority={CEILING} "
            f"max_concurrency={MAX_CONCURRENCY}\n{OPS_KEY} name=ops admin\n",
        )
        args = [
            "--tls-cert", str(self.router.cert), "--tls-key", str(self.router.key),
            "--api-key-file", str(keys), "--health-port", "0",
            "--worker-tls-ca", str(self.ca.cert),
        ]  # fmt: skip
        if client_cert:
            args += ["--worker-tls-cert", str(self.router_client.cert)]
            args += ["--worker-tls-key", str(self.router_client.key)]
        if worker_key is not None:
            args += ["--worker-api-key-file", str(self.write("worker-key.txt", worker_key))]
        return args

    def client(self, target: str, api_key: str | None, cert: Issued | None = None) -> Client:
        """An SDK client over TLS trusting the CA, presenting ``cert`` if given."""
        return Client(
            target,
            root_certificates=self.ca.cert_pem,
            certificate_chain=cert.cert_pem if cert else None,
            private_key=cert.key_pem if cert else None,
            api_key=api_key or "",
        )

    def channel_credentials(self, cert: Issued | None = None) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.ca.cert_pem, cert.key_pem if cert else None, cert.cert_pem if cert else None
        )

    def rotate(self, issued: Issued, name: str) -> Issued:
        """Replace ``issued``'s files with a new certificate for the same hosts, the way a
        Secret volume does (each file swapped whole); returns the new one."""
        fresh = self.ca.server(name)
        os.replace(fresh.key, issued.key)
        os.replace(fresh.cert, issued.cert)
        return issued


def served_certificate_serial(port: int, pki: Pki, cert: Issued) -> int:
    """The serial number of the certificate a TLS server on localhost presents now, seen on a
    fresh connection (with ``cert`` as the client certificate)."""
    context = ssl.create_default_context(cafile=str(pki.ca.cert))
    context.load_cert_chain(str(cert.cert), str(cert.key))
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number
