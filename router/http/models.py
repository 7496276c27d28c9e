"""What the HTTP door serves: the workers' model, asked once and kept.

The router has no model of its own; its workers all serve one, which `GetModelInfo` on any
of them describes. The door asks on first need and keeps the answer: it names the model in
``/v1/models`` and in every response, and gives chat its default ``max_tokens`` (the
context). A call naming another model makes the door ask again (at most once a second), so
workers restarted with a new model are noticed.

LoRA adapters are models too: a name that is not the served model's is looked up among the
adapters the workers have loaded (`ListLoraAdapters`, asked afresh each time, as adapters
come and go at run time); a call naming one runs the base model with that adapter
(`Request.adapter`). A name that is neither is a 404. ``/v1/models`` lists the base model
and then every adapter, each with the base model as its ``parent``.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from headrace.protos import control_pb2 as cpb
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

    async def check(self, model: str) -> tuple[pb.ModelInfo, str]:
        """The served model's description and the LoRA adapter ``model`` names ("" for the
        base model, which "" names too); NotFoundError if it names neither."""
        info = await self.get()
        if model and model != info.name:
            info = await self.get(refresh=True)
        if not model or model == info.name:
            return info, ""
        adapters = await self.adapters()
        if model in adapters:
            return info, model
        loaded = f" or one of its LoRA adapters {sorted(adapters)}" if adapters else ""
        raise NotFoundError(
            f"the model {model!r} does not exist; this server serves {info.name!r}{loaded}"
        )

    async def adapters(self) -> set[str]:
        """The LoRA adapters any healthy worker has loaded (a worker that cannot say is
        skipped: adapters are an addition to the model, never a condition for it)."""
        names: set[str] = set()
        for link in self.router.pool.accepting():
            try:
                response: cpb.ControlResponse = await link.generation_control.ListLoraAdapters(
                    cpb.ListLoraAdaptersRequest(), timeout=10, metadata=link.metadata
                )
            except grpc.RpcError:
                continue
            names.update(a.name for w in response.workers for a in w.lora_adapters)
        return names

    def describe(self, info: pb.ModelInfo, adapter: str = "") -> dict[str, object]:
        """The model (or one of its adapters) as /v1/models lists it."""
        entry: dict[str, object] = {
            "id": adapter or info.name,
            "object": "model",
            "created": self.created,
            "owned_by": "headrace",
            "max_model_len": info.max_model_len,
        }
        if adapter:
            entry["parent"] = info.name
        return entry
