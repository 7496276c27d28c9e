"""Real X.509 certificates for tests, made with `cryptography`: a CA, server certificates for
127.0.0.1 / localhost, client certificates. Each is written as PEM files in a folder."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES: tuple[str, ...] = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key.read_bytes()

    @property
    def serial(self) -> int:
        return x509.load_pem_x509_certificate(self.cert_pem).serial_number


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into ``folder``."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(name)
        certificate = (
            _builder(subject, subject, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self._certificate = certificate
        folder.mkdir(parents=True, exist_ok=True)
        self.cert = folder / f"{name}.crt"
        self.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    @property
    def cert_pem(self) -> bytes:
        return self.cert.read_bytes()

    def server(self, name: str, hosts: tuple[str, ...] = LOOPBACK_NAMES) -> Issued:
        """A server certificate valid for ``hosts`` (DNS names or IP addresses)."""
        names = [_alt_name(host) for host in hosts]
        return self._issue(
            name,
            ExtendedKeyUsageOID.SERVER_AUTH,
            x509.SubjectAlternativeName(names),
        )

    def client(self, name: str) -> Issued:
        return self._issue(name, ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def _issue(
        self,
        name: str,
        usage: x509.ObjectIdentifier,
        alt_names: x509.SubjectAlternativeName | None,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            _builder(_name(name), self._certificate.subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if alt_names is not None:
            builder = builder.add_extension(alt_names, critical=False)
        certificate = builder.sign(self._key, hashes.SHA256())
        issued = Issued(self.folder / f"{name}.crt", self.folder / f"{name}.key")
        issued.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return issued


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
    )


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
