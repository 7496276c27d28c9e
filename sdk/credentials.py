"""What a client presents to a headrace server: TLS and an API key; and how the key travels.

An API key travels as ``authorization: Bearer KEY`` metadata on every call (`bearer_metadata`
writes it, `bearer_token` reads it on the server), not as gRPC call credentials: those are
only sent over TLS, and behind a mesh that terminates mTLS in a sidecar the server's own port
is plaintext. `HEADRACE_API_KEY` is the default key of the SDK and the CLI; `default_api_key`
is the one place that reads it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.tls import ClientTls, FilesSignature, signature

API_KEY_ENV = "HEADRACE_API_KEY"
AUTHORIZATION = "authorization"
_SCHEME = "bearer"

Metadata = tuple[tuple[str, str], ...]


def default_api_key() -> str | None:
    """$HEADRACE_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def bearer_metadata(api_key: str | None) -> Metadata:
    """The call metadata that carries ``api_key`` (none for None)."""
    if api_key is None:
        return ()
    if not api_key or any(c.isspace() for c in api_key):
        raise InvalidArgumentError("api_key", "must be non-empty, without whitespace")
    return ((AUTHORIZATION, f"Bearer {api_key}"),)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The key in a call's ``authorization: Bearer KEY`` metadata, or None."""
    for key, value in metadata or ():
        if key != AUTHORIZATION or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == _SCHEME and token.strip():
            return token.strip()
    return None


def read_api_key(path: Path | str, flag: str) -> str:
    """The key in a file (its first line that is not blank or a '#' comment)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise InvalidArgumentError(flag, f"cannot read {path}: {error}") from None
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            return key
    raise InvalidArgumentError(flag, f"{path} holds no key")


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client reaches a server: TLS (None: plaintext) and an API key (None: none)."""

    tls: ClientTls | None = None
    #: Sent as bearer metadata; never printed.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        bearer_metadata(self.api_key)  # checks it

    @property
    def metadata(self) -> Metadata:
        return bearer_metadata(self.api_key)

    def signature(self) -> FilesSignature:
        """Changes when a certificate file changes: time for a new channel."""
        return signature(self.tls.files) if self.tls is not None else ()

    def channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """An aio channel to ``target`` with the certificate files as they are now."""
        if self.tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        options = [*options, *self.tls.channel_options()]
        return grpc.aio.secure_channel(target, self.tls.credentials(), options=options)
