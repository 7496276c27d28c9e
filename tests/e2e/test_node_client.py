"""A client in another language: Node's @grpc/grpc-js, loading only the `.proto` files,
streams a generation from a real worker and through a router (`make install` installs its
packages), in plaintext and over TLS with an API key; on `GenerateOne` it sends no
request_id, as a request built by hand from the `.proto` would; a beam search's scores come
back on its beams' chunks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from headrace.sdk.config import GenerationConfig
from headrace.worker.engine.llm import LLM

from tests.e2e.security import CLIENT_KEY, ROUTER_KEY, Pki

NODE_DIR = Path(__file__).parent / "node"
PROMPT = "a story about the sea"
MAX_TOKENS = 10


def _node_client(target: str, *mode: str) -> list[dict[str, object]]:
    done = _run_node_client(target, *mode)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _run_node_client(target: str, *mode: str) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    assert node is not None, "node is not installed"
    assert (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "the Node client's packages are missing: run `make install`"
    )
    return subprocess.run(
        [node, str(NODE_DIR / "client.js"), target, PROMPT, str(MAX_TOKENS), *mode],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mode", [[], ["--one"]], ids=["Generate", "GenerateOne"])
@pytest.mark.parametrize("server", ["worker", "router"])
def test_node_client_streams_the_same_tokens(
    request: pytest.FixtureRequest, offline: LLM, mode: list[str], server: str
) -> None:
    target = request.getfixturevalue(server)
    target = target if isinstance(target, str) else target.target
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = offline.generate(PROMPT, config)[0]
    _assert_streamed(_node_client(target, *mode), want.token_ids, want.text, mode)


def _assert_streamed(
    chunks: list[dict[str, object]], token_ids: list[int], text: str, mode: list[str]
) -> None:
    assert len(chunks) == MAX_TOKENS  # one message per engine step, one token each
    assert [t for c in chunks for t in c["token_ids"]] == token_ids  # type: ignore[attr-defined]
    assert "".join(str(c["text"]) for c in chunks) == text
    assert chunks[-1]["finished"] is True
    assert chunks[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    (request_id,) = {c["request_id"] for c in chunks}
    if mode == ["--one"]:  # sent without an id: the server chose one
        assert request_id not in ("", "node-1")
    else:
        assert request_id == "node-1"


@pytest.mark.parametrize("mode", [[], ["--one"]], ids=["Generate", "GenerateOne"])
@pytest.mark.parametrize("server", ["secure_worker", "secure_router"])
def test_node_client_over_tls_with_a_key(
    request: pytest.FixtureRequest, pki: Pki, offline: LLM, mode: list[str], server: str
) -> None:
    """The router asks for a key over TLS; the worker also wants a client certificate."""
    target = request.getfixturevalue(server).target
    tls = ["--tls-ca", str(pki.ca.cert)]
    if server == "secure_worker":
        tls += ["--tls-cert", str(pki.tester.cert), "--tls-key", str(pki.tester.key)]
    key = ROUTER_KEY if server == "secure_worker" else CLIENT_KEY
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = offline.generate(PROMPT, config)[0]
    chunks = _node_client(target, *mode, *tls, "--api-key", key)
    _assert_streamed(chunks, want.token_ids, want.text, mode)
    refused = _run_node_client(target, *mode, *tls)  # the same without the key
    assert refused.returncode == 1 and "16 UNAUTHENTICATED" in refused.stderr, refused.stderr


@pytest.mark.parametrize("server", ["worker", "router"])
def test_node_client_sends_constraints_and_logit_controls(
    request: pytest.FixtureRequest, offline: LLM, server: str
) -> None:
    """The new GenerationConfig fields, built by hand from the .proto: a JSON schema (as its
    text), a choice, a logit bias (a map keyed by token id)."""
    target = request.getfixturevalue(server)
    target = target if isinstance(target, str) else target.target
    schema = {"type": "string", "enum": ["north", "south"]}
    for fields, want_config in (
        ({"json_schema": json.dumps(schema), "ignore_eos": False}, {"json_schema": schema}),
        ({"choice": ["east", "west"], "ignore_eos": False}, {"choice": ("east", "west")}),
        ({"logit_bias": {"9": 100}}, {"logit_bias": {9: 100.0}, "ignore_eos": True}),
    ):
        config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, **want_config)
        want = offline.generate(PROMPT, config)[0]
        chunks = _node_client(target, "--config", json.dumps(fields))
        assert [t for c in chunks for t in c["token_ids"]] == want.token_ids  # type: ignore[attr-defined]
        assert "".join(str(c["text"]) for c in chunks) == want.text
    assert want.token_ids == [9] * MAX_TOKENS


@pytest.mark.parametrize("server", ["worker", "router"])
def test_node_client_gets_the_best_beams_with_their_scores(
    request: pytest.FixtureRequest, offline: LLM, server: str
) -> None:
    """num_beams, n and early_stopping (a string on the wire) built by hand from the .proto;
    each returned beam comes whole in one chunk with its cumulative logprob and score."""
    target = request.getfixturevalue(server)
    target = target if isinstance(target, str) else target.target
    fields = {"num_beams": 3, "n": 2, "length_penalty": 0.5, "early_stopping": "never"}
    chunks: list[Any] = _node_client(target, "--config", json.dumps({**fields, "temperature": 0}))
    beams = sorted((c for c in chunks if c["token_ids"]), key=lambda c: c["index"])
    assert [c["index"] for c in beams] == [0, 1]  # one chunk per beam: nothing streamed before
    for beam in beams:
        assert beam["cumulative_logprob"] is not None and beam["cumulative_logprob"] < 0
        want_score = beam["cumulative_logprob"] / len(beam["token_ids"]) ** 0.5
        assert beam["beam_score"] == pytest.approx(want_score, rel=1e-4)
    assert beams[0]["beam_score"] >= beams[1]["beam_score"]  # best first
    assert chunks[-1]["finished"] is True
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **fields)
    want = offline.generate(PROMPT, config)[0]
    assert [c["token_ids"] for c in beams] == [o.token_ids for o in want.outputs]
    assert [c["beam_score"] for c in beams] == pytest.approx(
        [o.beam_score for o in want.outputs], rel=1e-5
    )
