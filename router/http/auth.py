"""API keys at the HTTP door: the gRPC port's own check, asked with the HTTP header.

A router with ``--api-key-file`` wants ``Authorization: Bearer KEY`` on every HTTP call but
``/health``, exactly as on gRPC: the door asks the gRPC port's `ApiKeyInterceptor` (missing
or unknown key: 401), and a key with limits becomes the `auth.Caller` of the call's
`RouterSession`, counted in the same `KeyLimits` as the key's gRPC requests, so a key's
priority ceiling (403) and max_concurrency (429) hold across both doors.
"""

from __future__ import annotations

from headrace.sdk import auth
from headrace.sdk.credentials import AUTHORIZATION


class HttpAuth:
    """Who calls; with no key check (a server without keys) anyone may."""

    def __init__(self, check: auth.ApiKeyInterceptor | None) -> None:
        self.check = check

    def caller(self, authorization: str | None, method: str, peer: str) -> auth.Caller | None:
        """The call's key when it has per-request limits, else None; raises
        UnauthenticatedError for a missing or unknown key."""
        if self.check is None:
            return None
        metadata = [(AUTHORIZATION, authorization)] if authorization is not None else []
        key = self.check.authorize(auth.GENERATE, metadata)
        if not key.has_limits:
            return None
        return auth.Caller(key, self.check.limits, method, peer)
