"""`Adapters`: the engine's LoRA adapters: which names requests may use, loading and unloading
them on every rank between steps.

Decision: unloading an adapter that unfinished requests use is refused (FAILED_PRECONDITION,
naming how many use it) rather than waited for: the caller decides whether to drain those
requests (or abort them) and try again, and no control call ever blocks on generation.
An unknown adapter on a request is NOT_FOUND naming it, for that request alone.

Each load gets a fresh number (`Sequence.lora_id`); the prefix cache keys on it, so neither two
adapters nor two loads of one name ever share KV.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from headrace.sdk.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
)
from headrace.worker.distributed.rank_control import LoadLora, RankCommandError, UnloadLora
from headrace.worker.execution.interface import Executor
from headrace.worker.lora.manager import AdapterInfo, LoraManager


class Adapters:
    """The adapters of one engine; loads and unloads run between steps (the engine settles
    its steps in flight first)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._load_ids = itertools.count(1)
        manager = executor.lora
        #: Loaded adapters by name (replaced, never mutated, so any thread may read it).
        self.loaded: dict[str, tuple[int, AdapterInfo]] = {}
        if manager is not None:  # the adapters of --lora, loaded with the model
            self.loaded = {n: (next(self._load_ids), i) for n, i in manager.registered.items()}

    @property
    def enabled(self) -> bool:
        return self.executor.lora is not None

    def resolve(self, name: str | None) -> tuple[str, int] | None:
        """(name, load number) of the adapter a request names; None for the base model."""
        if name is None or name == "":
            return None
        if not isinstance(name, str):
            raise InvalidArgumentError("adapter", f"must be a string, got {name!r}")
        entry = self.loaded.get(name)
        if entry is None:
            raise NotFoundError(f"LoRA adapter {name!r} is not loaded on this worker")
        return name, entry[0]

    def list(self) -> list[AdapterInfo]:
        return [info for _, info in self.loaded.values()]

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read and check the adapter, then load it on every rank; InvalidArgumentError if
        it is unusable (rank too high, a target module the model lacks, unreadable)."""
        manager = self._manager()
        if not name or not isinstance(name, str):
            raise InvalidArgumentError("name", "must be a non-empty string")
        if name in self.loaded:
            raise InvalidArgumentError("name", f"adapter {name!r} is already loaded")
        manager.read(name, path)  # typed errors, before any rank changes
        self._run(LoadLora(name, str(path)))
        info = manager.registered[name]
        self.loaded = {**self.loaded, name: (next(self._load_ids), info)}
        return info

    def unload(self, name: str, num_users: int) -> None:
        """Forget the adapter on every rank; refused while ``num_users`` (the engine's
        unfinished requests that use it) is not 0."""
        self._manager()
        if name not in self.loaded:
            raise NotFoundError(f"LoRA adapter {name!r} is not loaded on this worker")
        if num_users:
            raise FailedPreconditionError(
                f"LoRA adapter {name!r} is in use by {num_users} unfinished request(s); "
                "unload it once they finish"
            )
        self._run(UnloadLora(name))
        self.loaded = {n: entry for n, entry in self.loaded.items() if n != name}

    def _manager(self) -> LoraManager:
        manager = self.executor.lora
        if manager is None:
            raise FailedPreconditionError("LoRA is not enabled on this worker (--enable-lora)")
        return manager

    def _run(self, command: LoadLora | UnloadLora) -> None:
        try:
            self.executor.control(command)
        except RankCommandError as exc:
            raise InternalError(f"LoRA adapter call failed: {exc}") from exc
