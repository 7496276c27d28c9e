"""The worker: engine, scheduler, KV cache, sampling, models.

The in-process APIs: `LLM` for offline batches, `AsyncEngine` for servers. They are imported
on first use, so importing a submodule (the scheduler, say) does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from headrace.sdk.outputs import Completion, GenerationResult, SampleDelta
    from headrace.worker.config import EngineConfig
    from headrace.worker.engine.async_engine import AsyncEngine, OutputStream
    from headrace.worker.engine.engine import Engine
    from headrace.worker.engine.llm import LLM
    from headrace.worker.engine.outputs import RequestOutput

#: Exported name -> the module that defines it.
_EXPORTS = {
    "AsyncEngine": "headrace.worker.engine.async_engine",
    "OutputStream": "headrace.worker.engine.async_engine",
    "EngineConfig": "headrace.worker.config",
    "Engine": "headrace.worker.engine.engine",
    "RequestOutput": "headrace.worker.engine.outputs",
    "LLM": "headrace.worker.engine.llm",
    "Completion": "headrace.sdk.outputs",
    "GenerationResult": "headrace.sdk.outputs",
    "SampleDelta": "headrace.sdk.outputs",
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
    return getattr(importlib.import_module(module), name)
