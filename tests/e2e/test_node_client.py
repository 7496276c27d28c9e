"""A client in another language: Node's @grpc/grpc-js, loading only the `.proto` files,
streams a generation from a real worker and through a router (`make install` installs its
packages)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import start_router
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import ServerProcess, wait_serving

NODE_DIR = Path(__file__).parent / "node"
PROMPT = "a story about the sea"
MAX_TOKENS = 10


def _node_client(target: str, *mode: str) -> list[dict[str, object]]:
    node = shutil.which("node")
    assert node is not None, "node is not installed"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "the Node client's packages are missing: run `make install`"
    )
    done = subprocess.run(
        [node, str(NODE_DIR / "client.js"), target, PROMPT, str(MAX_TOKENS), *mode],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def router(worker: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("node-router") / "router.log"
    with start_router([worker.target], log_path=log) as process:
        assert wait_serving(process.target)
        yield process.target


@pytest.mark.parametrize("mode", [[], ["--one"]], ids=["Generate", "GenerateOne"])
@pytest.mark.parametrize("server", ["worker", "router"])
def test_node_client_streams_the_same_tokens(
    request: pytest.FixtureRequest, offline: LLM, mode: list[str], server: str
) -> None:
    target = request.getfixturevalue(server)
    target = target if isinstance(target, str) else target.target
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = offline.generate(PROMPT, config)[0]
    chunks = _node_client(target, *mode)
    assert len(chunks) == MAX_TOKENS  # one message per engine step, one token each
    assert [t for c in chunks for t in c["token_ids"]] == want.token_ids  # type: ignore[attr-defined]
    assert "".join(str(c["text"]) for c in chunks) == want.text
    assert chunks[-1]["finished"] is True
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert {c["request_id"] for c in chunks} == {"node-1"}
