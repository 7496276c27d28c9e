"""End-to-end fixtures: a tiny random-weight checkpoint served by a real worker process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import ServerProcess, start_worker
from tests.factories import cached_checkpoint


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return cached_checkpoint("llama", max_position_embeddings=512)


@pytest.fixture(scope="session")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One worker serving the tiny model, shared by the tests that leave it running."""
    with start_worker(tiny_model, tmp_path_factory.mktemp("worker")) as process:
        yield process


@pytest.fixture(scope="session")
def offline(tiny_model: Path) -> LLM:
    """The in-process API over the same checkpoint: the reference for what gRPC returns."""
    return LLM(str(tiny_model))
