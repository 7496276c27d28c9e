"""A worker link's side of security: the router's key on every call, and a new TLS channel
from the certificate files once they changed (used from the next connection on)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from headrace.router.config import RouterConfig
from headrace.router.workers import WorkerLink
from headrace.sdk.credentials import ClientSecurity
from headrace.sdk.tls import ClientTls

from tests.certs import CertificateAuthority

KEY = "router-key-0123456789abcdef"


class _NoEvents:
    def on_response(self, link: object, response: object) -> None: ...
    def on_down(self, link: object, orphans: object) -> None: ...
    def on_change(self) -> None: ...


def test_a_link_sends_its_key_and_makes_a_new_channel_after_files_change(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path, "ca")
    client = ca.client("router")
    security = ClientSecurity(ClientTls(ca.cert, client.cert, client.key), api_key=KEY)
    config = RouterConfig(workers=("127.0.0.1:1",), worker_security=security)

    async def run() -> None:
        link = WorkerLink("127.0.0.1:1", config, _NoEvents())
        assert link.metadata == (("authorization", f"Bearer {KEY}"),)
        first = link.channel
        await link._reconnect_if_rotated()
        assert link.channel is first  # nothing changed: the same channel
        rotated = ca.client("router-rotated")
        os.replace(rotated.cert, client.cert)
        os.replace(rotated.key, client.key)
        await link._reconnect_if_rotated()
        assert link.channel is not first
        client.key.write_text("")  # caught mid-write: keep the channel, retry later
        second = link.channel
        await link._reconnect_if_rotated()
        assert link.channel is second
        await link.channel.close()

    asyncio.run(run())
