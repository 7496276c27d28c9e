"""`OutputStream`: per-step batches of a request's outputs, from the engine thread to asyncio."""

from __future__ import annotations

import asyncio

from headrace.sdk.streams import FlowHooks, FlowLimits, ResponseQueue
from headrace.worker.engine.outputs import RequestOutput


class OutputStream:
    """Per-step batches of outputs, delivered onto one asyncio loop.

    A server's stream passes its flow-control hooks: past the limits' backlog of unsent
    batches, the hooks are asked to hold its requests (see `headrace.sdk.streams`); without
    hooks nothing is held.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        limits: FlowLimits | None = None,
        hooks: FlowHooks | None = None,
    ) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: ResponseQueue[list[RequestOutput]] = ResponseQueue(limits, hooks)

    def put(self, outputs: list[RequestOutput]) -> None:
        """Called from the engine thread (or the loop's)."""
        self._loop.call_soon_threadsafe(self._queue.put, outputs)

    async def get(self) -> list[RequestOutput]:
        return await self._queue.get()
