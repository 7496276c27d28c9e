"""The worker: engine, scheduler, KV cache, sampling, models.

The in-process APIs: `LLM` for offline batches, `AsyncEngine` for servers. They are imported
on first use, so importing a submodule (the scheduler, say) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headrace.worker.config import EngineConfig
    from headrace.worker.engine.async_engine import AsyncEngine, OutputStream
    from headrace.worker.engine.engine import Engine, RequestOutput, SampleDelta
    from headrace.worker.engine.llm import LLM, Completion, GenerationResult

_EXPORTS = {
    "AsyncEngine": "engine.async_engine",
    "OutputStream": "engine.async_engine",
    "EngineConfig": "config",
    "Engine": "engine.engine",
    "RequestOutput": "engine.engine",
    "SampleDelta": "engine.engine",
    "LLM": "engine.llm",
    "Completion": "engine.llm",
    "GenerationResult": "engine.llm",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "Completion",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "OutputStream",
    "RequestOutput",
    "SampleDelta",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'headrace.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"headrace.worker.{module}"), name)
