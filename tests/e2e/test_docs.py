"""The README's Python examples run as written, against a real worker serving the default
model (SmolLM2-135M-Instruct, prepared once per session), each in a fresh interpreter: an
example that breaks fails here, not in a new user's first hour. The only change made to an
example is the server's address (the test's worker listens on a free port; examples of the
OpenAI-compatible API talk to a router with an HTTP port in front of it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from headrace.sdk.launch import ServerProcess, start_router, start_worker
from headrace.sdk.serving import wait_serving
from headrace.worker.models.store import CACHE_ENV

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
README_TARGET = "localhost:50051"
README_HTTP_TARGET = "localhost:8000"


def python_snippets() -> list[str]:
    return SNIPPET.findall(README.read_text())


@pytest.fixture(scope="module")
def default_worker(prepared_cache: Path, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    env_before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(prepared_cache)  # the child finds the prepared model here
    try:
        log = tmp_path_factory.mktemp("readme") / "worker.log"
        with start_worker("smollm2-135m-instruct", log_path=log) as worker:
            yield worker
    finally:
        if env_before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = env_before


def test_the_readme_has_the_examples_this_test_runs() -> None:
    snippets = python_snippets()
    assert len(snippets) >= 3
    assert any("Client(" in s for s in snippets) and any("LLM(" in s for s in snippets)


@pytest.fixture(scope="module")
def default_router(default_worker: ServerProcess, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    log = tmp_path_factory.mktemp("readme-router") / "router.log"
    with start_router([default_worker.target], "--http-port", "0", log_path=log) as router:
        assert wait_serving(router.target)
        yield router


@pytest.mark.parametrize("index", range(len(python_snippets())))
def test_a_readme_example_runs(
    index: int, default_worker: ServerProcess, prepared_cache: Path, request: pytest.FixtureRequest
) -> None:
    snippet = python_snippets()[index].replace(README_TARGET, default_worker.target)
    if README_HTTP_TARGET in snippet:
        router = request.getfixturevalue("default_router")
        snippet = snippet.replace(README_HTTP_TARGET, f"127.0.0.1:{router.http_port}")
    done = subprocess.run(
        [sys.executable, "-c", snippet],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, CACHE_ENV: str(prepared_cache)},
    )
    assert done.returncode == 0, f"example {index} failed:\n{snippet}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"example {index} printed nothing"
    if "capital of France" in snippet:  # greedy facts: the examples promise a sensible answer
        assert "Paris" in done.stdout, done.stdout
