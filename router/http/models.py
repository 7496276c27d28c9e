"""What the HTTP door serves: the workers' model, asked once and kept.

The router has no model of its own; its workers all serve one, which `GetModelInfo` on any
of them describes. The door asks on first need and keeps the answer: it names the model in
``/v1/models`` and in every response, and gives chat its default ``max_tokens`` (the
context). A call naming another model makes the door ask again (at most once a second), so
workers restarted with a new model are noticed; a name still unknown is a 404.
"""

from __future__ import annotations

import asyncio
import time

from headrace.protos import generation_pb2 as pb
from headrace.router.router import Router
from headrace.sdk.errors import NotFoundError

#: The shortest time between two questions to the workers.
REFRESH_AFTER_S = 1.0


class ModelCatalog:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.info: pb.ModelInfo | None = None
        self._asked_s = 0.0
        self._lock = asyncio.Lock()
        #: When the door first knew the model (``created`` in /v1/models).
        self.created = int(time.time())

    async def get(self, refresh: bool = False) -> pb.ModelInfo:
        """The served model's description; UnavailableError while no worker can say."""
        async with self._lock:
            stale = refresh and time.monotonic() - self._asked_s >= REFRESH_AFTER_S
            if self.info is None or stale:
                self.info = await self.router.model_info()
                self._asked_s = time.monotonic()
            return self.info

    async def check(self, model: str) -> pb.ModelInfo:
        """The model's description if ``model`` names it ("" does); else NotFoundError."""
        info = await self.get()
        if model and model != info.name:
            info = await self.get(refresh=True)
        if model and model != info.name:
            raise NotFoundError(
                f"the model {model!r} does not exist; this server serves {info.name!r}"
            )
        return info

    def describe(self, info: pb.ModelInfo) -> dict[str, object]:
        """The model as /v1/models lists it."""
        return {
            "id": info.name,
            "object": "model",
            "created": self.created,
            "owned_by": "headrace",
            "max_model_len": info.max_model_len,
        }
