"""`ErrorGuard`: nothing the door raises reaches the ASGI server (uvicorn would answer with
a plain 500 or, once a response started, drop the keep-alive connection)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from headrace.router.http.errors import ErrorGuard


def run(app: Any) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(ErrorGuard(app)({"type": "http"}, receive, send))  # raises nothing
    return sent


def test_a_bug_before_the_response_is_a_500_in_openai_shape():
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise KeyError("oops")

    start, body = run(app)
    assert start["status"] == 500
    error = json.loads(body["body"])["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "KeyError" in error["message"] and not body.get("more_body")


def test_a_bug_mid_stream_ends_the_response_it_began():
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        raise RuntimeError("mid-stream")

    sent = run(app)
    assert [m.get("more_body", False) for m in sent[1:]] == [True, False]


def test_a_bug_after_the_response_sends_nothing_more():
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
        raise RuntimeError("re-raised, as Starlette's error middleware does")

    assert len(run(app)) == 2
