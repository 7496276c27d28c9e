"""End-to-end fixtures: a tiny random-weight checkpoint served by a real worker process, and
a worker and router guarded by TLS, mTLS and API keys (`tests/e2e/security.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import ServerProcess, start_router, start_worker, wait_serving
from tests.e2e.security import Pki
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
def router(worker: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router in front of the shared worker: its target."""
    log = tmp_path_factory.mktemp("router") / "router.log"
    with start_router([worker.target], log_path=log) as process:
        assert wait_serving(process.target)
        yield process.target


@pytest.fixture(scope="session")
def offline(tiny_model: Path) -> LLM:
    """The in-process API over the same checkpoint: the reference for what gRPC returns."""
    return LLM(str(tiny_model))


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.make(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def secure_worker(
    tiny_model: Path, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The tiny model behind TLS, mTLS and API keys, with a plaintext health port."""
    logs = tmp_path_factory.mktemp("secure-worker")
    with start_worker(tiny_model, logs, *pki.worker_args()) as process:
        yield process


@pytest.fixture(scope="session")
def secure_router(
    secure_worker: ServerProcess, pki: Pki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A router with TLS and API keys, talking TLS + a key to `secure_worker`."""
    log = tmp_path_factory.mktemp("secure-router") / "router.log"
    with start_router([secure_worker.target], *pki.router_args(), log_path=log) as process:
        assert wait_serving(f"127.0.0.1:{process.health_port}"), log.read_text()[-2000:]
        yield process
