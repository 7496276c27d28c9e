"""TLS files (`sdk/tls.py`) and the server's security flags (`sdk/security.py`): files checked
once at start with errors naming the flag, certificates re-read only when they change, and
the one warning of a server open beyond loopback."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest
from headrace.sdk.api_keys import ApiKeys
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.security import (
    ServerSecurity,
    add_server_security_arguments,
    is_loopback,
    server_security,
)
from headrace.sdk.tls import ClientTls, ServerTls, _ServerCertificates

from tests.certs import CertificateAuthority

KEY_LINE = "caller-key-0123456789abcdef\n"


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority(tmp_path / "pki", "test-ca")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_security_arguments(parser)
    return parser.parse_args(argv)


def test_certificates_are_read_again_only_when_a_file_changed(ca: CertificateAuthority) -> None:
    first = ca.server("server")
    certificates = _ServerCertificates(ServerTls(first.cert, first.key, ca.cert))
    assert certificates.fetch() is None  # nothing changed: gRPC keeps what it has
    rotated = ca.server("rotated")
    os.replace(rotated.cert, first.cert)  # as a Secret volume swaps its files
    os.replace(rotated.key, first.key)
    assert certificates.fetch() is not None
    assert certificates.fetch() is None


def test_an_unreadable_file_keeps_the_last_certificate(
    ca: CertificateAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    server = ca.server("server")
    certificates = _ServerCertificates(ServerTls(server.cert, server.key))
    server.key.write_text("")  # caught mid-rotation
    with caplog.at_level(logging.WARNING):
        assert certificates.fetch() is None
    assert "keeping the current TLS certificate" in caplog.text
    server.key.write_bytes(ca.server("again").key_pem)
    assert certificates.fetch() is not None


def test_missing_files_are_refused_at_start_naming_the_flag(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    server = ca.server("server")
    with pytest.raises(InvalidArgumentError, match=r"^tls_key: cannot read"):
        ServerTls(server.cert, tmp_path / "nope.key")
    with pytest.raises(InvalidArgumentError, match=r"^tls_client_ca: cannot read"):
        ServerTls(server.cert, server.key, tmp_path / "nope.crt")
    with pytest.raises(InvalidArgumentError, match="together"):
        ClientTls(ca.cert, cert_file=server.cert)
    with pytest.raises(InvalidArgumentError, match="together"):
        server_security(_args("--tls-cert", str(server.cert)))


def test_the_flags_build_tls_and_keys(ca: CertificateAuthority, tmp_path: Path) -> None:
    server = ca.server("server")
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY_LINE)
    security = server_security(
        _args("--tls-cert", str(server.cert), "--tls-key", str(server.key),
              "--tls-client-ca", str(ca.cert), "--api-key-file", str(keys))
    )  # fmt: skip
    assert security.tls is not None and security.tls.requires_client_certificate
    assert security.api_keys is not None and len(security.api_keys.keys) == 1
    assert server_security(_args()) == ServerSecurity()  # no flags: open, as before


@pytest.mark.parametrize(
    ("host", "security", "warned"),
    [
        ("0.0.0.0", ServerSecurity(), True),
        ("10.1.2.3", ServerSecurity(), True),
        ("127.0.0.1", ServerSecurity(), False),
        ("::1", ServerSecurity(), False),
        ("localhost", ServerSecurity(), False),
        ("0.0.0.0", ServerSecurity(api_keys=ApiKeys.parse(KEY_LINE)), False),
    ],
)
def test_an_open_server_beyond_loopback_warns_once(
    host: str, security: ServerSecurity, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        security.warn_if_open(host, 50051)
    assert len(caplog.records) == int(warned)
    if warned:
        assert "without API keys or client certificates" in caplog.text
        assert "\n" not in caplog.records[0].getMessage()


def test_client_certificates_alone_count_as_authentication(
    ca: CertificateAuthority, caplog: pytest.LogCaptureFixture
) -> None:
    server = ca.server("server")
    mutual = ServerSecurity(tls=ServerTls(server.cert, server.key, ca.cert))
    plain_tls = ServerSecurity(tls=ServerTls(server.cert, server.key))
    with caplog.at_level(logging.WARNING):
        mutual.warn_if_open("0.0.0.0", 50051)
        assert not caplog.records
        plain_tls.warn_if_open("0.0.0.0", 50051)  # TLS alone: anyone may still connect
    assert len(caplog.records) == 1
    assert is_loopback("127.3.4.5") and not is_loopback("headrace-worker")
