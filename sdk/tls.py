"""TLS for headrace's listeners and links: certificate files, and credentials that follow them.

Design note. A server's certificate, key and client CA are files (`--tls-cert`, `--tls-key`,
`--tls-client-ca`), and rotating them must not need a restart. gRPC's dynamic server
credentials ask a fetcher for the certificate configuration at every new TLS handshake;
`_ServerCertificates.fetch` compares the files' (inode, size, mtime) with what it last loaded
and reads them again only when one changed, so a handshake costs three `stat` calls.
Connections already open keep the certificate they were made with. A Kubernetes Secret volume
swaps all its files at once; a tool that writes them one by one may leave the pair mismatched
for an instant, and handshakes in that instant fail until the second file lands (the next
handshake reads both again). A file that cannot be read keeps the last good configuration,
with a warning.

A client's side is `ClientTls`: the CA it trusts, and its own certificate for mTLS. The
router's links to workers build their channels from it, and build them again after a worker
went away if the files changed since, so a rotated CA or client certificate is used from the
next connection on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from headrace.sdk.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: (inode, size, mtime_ns) of each file; None for a file that is not there.
FilesSignature = tuple[tuple[int, int, int] | None, ...]


def read_pem(path: Path, flag: str) -> bytes:
    """The file's bytes; InvalidArgumentError naming the flag if unreadable or empty."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise InvalidArgumentError(flag, f"cannot read {path}: {error}") from None
    if not data.strip():
        raise InvalidArgumentError(flag, f"{path} is empty")
    return data


def signature(paths: tuple[Path | None, ...]) -> FilesSignature:
    """What changes when any of the files is replaced or rewritten."""
    marks = []
    for path in paths:
        try:
            stat = os.stat(path) if path is not None else None
        except OSError:
            stat = None
        marks.append(None if stat is None else (stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(marks)


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A listener's TLS: its certificate chain and key, and for mTLS the client CA."""

    #: PEM certificate chain the server presents (--tls-cert).
    cert_file: Path
    #: PEM private key of that certificate (--tls-key).
    key_file: Path
    #: PEM CA bundle that client certificates must chain to (--tls-client-ca); set, a client
    #: without such a certificate is refused during the handshake. None: no client certificates.
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        read_pem(self.cert_file, "tls_cert")
        read_pem(self.key_file, "tls_key")
        if self.client_ca_file is not None:
            read_pem(self.client_ca_file, "tls_client_ca")

    @property
    def requires_client_certificate(self) -> bool:
        return self.client_ca_file is not None

    @property
    def files(self) -> tuple[Path | None, ...]:
        return (self.cert_file, self.key_file, self.client_ca_file)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The files as they are now."""
        client_ca = self.client_ca_file
        return grpc.ssl_server_certificate_configuration(
            [(read_pem(self.key_file, "tls_key"), read_pem(self.cert_file, "tls_cert"))],
            root_certificates=read_pem(client_ca, "tls_client_ca") if client_ca else None,
        )

    def credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up new files at the next handshake."""
        certificates = _ServerCertificates(self)
        return grpc.dynamic_ssl_server_credentials(
            certificates.initial,
            certificates.fetch,
            require_client_authentication=self.requires_client_certificate,
        )


class _ServerCertificates:
    """The configuration last loaded from a `ServerTls`'s files, and when it was."""

    def __init__(self, tls: ServerTls) -> None:
        self.tls = tls
        self.loaded = signature(tls.files)
        self.initial = tls.configuration()

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC at each handshake: a new configuration, or None to keep the last."""
        now = signature(self.tls.files)
        if now == self.loaded:
            return None
        try:
            configuration = self.tls.configuration()
        except InvalidArgumentError as error:
            logger.warning("keeping the current TLS certificate: %s", error)
            return None
        self.loaded = now
        logger.info("TLS certificate files changed; serving them from now on")
        return configuration


@dataclass(frozen=True, slots=True)
class ClientTls:
    """A client's TLS: whom it trusts and, for mTLS, the certificate it presents."""

    #: PEM CA bundle that the server's certificate must chain to; None: the system's roots.
    ca_file: Path | None = None
    #: PEM client certificate chain and its key, both or neither.
    cert_file: Path | None = None
    key_file: Path | None = None
    #: The name the server's certificate must carry, when it differs from the host dialled
    #: (the router dials workers by pod IP; their certificate names the Service).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgumentError("tls_cert", "give a client certificate and its key together")
        for path, flag in self._flagged_files():
            read_pem(path, flag)

    def _flagged_files(self) -> list[tuple[Path, str]]:
        named = ((self.ca_file, "tls_ca"), (self.cert_file, "tls_cert"), (self.key_file, "tls_key"))
        return [(path, flag) for path, flag in named if path is not None]

    @property
    def files(self) -> tuple[Path | None, ...]:
        return (self.ca_file, self.cert_file, self.key_file)

    def credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials from the files as they are now."""
        pems = {flag: read_pem(path, flag) for path, flag in self._flagged_files()}
        return grpc.ssl_channel_credentials(
            root_certificates=pems.get("tls_ca"),
            private_key=pems.get("tls_key"),
            certificate_chain=pems.get("tls_cert"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]
