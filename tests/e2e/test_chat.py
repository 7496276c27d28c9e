"""Chat on the wire: a conversation sent to a worker or through a router is rendered with the
model's chat template and answered exactly as the offline `LLM.chat`; a failover resumes it
exactly; `headrace generate` asks a chat model as a chat; the Node client sends one too."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import wire
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.launch import ServerProcess, start_router
from headrace.sdk.prompts import Chat
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import load_report, start_worker, two_workers_behind_a_router, wait_serving
from tests.e2e.test_node_client import NODE_DIR
from tests.factories import cached_checkpoint

QUESTION = [{"role": "user", "content": "Where does the quick brown fox run?"}]
GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_model() -> Path:
    return cached_checkpoint("qwen2", chat_template=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def chat_offline(chat_model: Path) -> LLM:
    return LLM(str(chat_model), dtype="float32")


@pytest.fixture(scope="module")
def chat_servers(
    chat_model: Path, tmp_path_factory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("chat")
    with (
        start_worker(chat_model, logs) as worker,
        start_router([worker.target], log_path=logs / "router.log") as router,
    ):
        assert wait_serving(router.target)
        yield worker, router


@pytest.mark.parametrize("through", ["worker", "router"])
def test_a_chat_over_the_wire_equals_the_offline_chat(chat_servers, chat_offline, through):
    worker, router = chat_servers
    target = worker.target if through == "worker" else router.target
    (want,) = chat_offline.chat(QUESTION, GREEDY)
    with Client(target) as client:
        got = client.chat(QUESTION, GREEDY)
        streamed = "".join(chunk.text for chunk in client.stream_chat(QUESTION, GREEDY))
    assert got.token_ids == want.token_ids and got.text == want.text == streamed
    assert got.usage.num_prompt_tokens == len(want.prompt_token_ids)
    request = wire.request_to_wire("r", Chat.of(QUESTION), GREEDY)
    request.return_prompt_token_ids = True
    with grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = next(iter(stub.GenerateOne(request, timeout=30))).chunks[0]
    assert list(first.prompt_token_ids) == want.prompt_token_ids  # the rendered prompt


def test_model_info_says_whether_chat_is_accepted(chat_servers, worker: ServerProcess):
    with Client(chat_servers[1].target) as client:
        assert client.model_info().has_chat_template
    with Client(worker.target) as client:
        assert not client.model_info().has_chat_template


def test_a_model_without_a_template_refuses_a_chat_naming_the_field(worker: ServerProcess):
    with Client(worker.target) as client, pytest.raises(InvalidArgumentError) as refused:
        client.chat(QUESTION, GREEDY)
    assert refused.value.field == "chat" and "no chat template" in str(refused.value)


def test_a_chat_request_fails_over_exactly(chat_model, chat_offline, tmp_path) -> None:
    long = GenerationConfig(max_tokens=120, temperature=0.0, ignore_eos=True)
    conversations = [[{"role": "user", "content": f"Tell tale number {i}"}] for i in range(12)]
    want = [r.token_ids for r in chat_offline.chat(conversations, long)]
    with two_workers_behind_a_router(chat_model, tmp_path) as (router, _, b):
        got = asyncio.run(_kill_mid_stream(router.target, b, conversations, long))
    assert got == want
    assert "resuming request" in (tmp_path / "router.log").read_text()


async def _kill_mid_stream(target, victim, conversations, config) -> list[list[int]]:  # type: ignore[no-untyped-def]
    async with AsyncClient(target) as client:
        streamed: list[list[int]] = [[] for _ in conversations]

        async def one(i: int) -> None:
            async for chunk in client.stream_chat(conversations[i], config):
                streamed[i].extend(chunk.token_ids)

        tasks = [asyncio.create_task(one(i)) for i in range(len(conversations))]
        while sum(map(len, streamed)) < len(conversations) * 10:
            await asyncio.sleep(0.01)
        assert load_report(victim.target).running_requests > 0  # mid-generation
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
    return streamed


def _headrace_generate(target: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", "generate", "--target", target, *args],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.decode()  # bytes: a generated "\r" must not become "\n"


def test_headrace_generate_asks_a_chat_model_as_a_chat(chat_servers, chat_offline) -> None:
    target = chat_servers[1].target
    question = QUESTION[0]["content"]
    flags = ["--max-tokens", "12", "--ignore-eos"]
    (want,) = chat_offline.chat(QUESTION, GREEDY)
    assert _headrace_generate(target, question, *flags) == want.text
    raw = chat_offline.generate(question, GREEDY)[0]
    assert _headrace_generate(target, question, "--raw", *flags) == raw.text


def test_the_node_client_sends_a_chat(chat_servers, chat_offline) -> None:
    (want,) = chat_offline.chat(
        QUESTION, GenerationConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    done = subprocess.run(
        ["node", str(NODE_DIR / "client.js"), chat_servers[1].target, QUESTION[0]["content"], "8",
         "--chat"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    chunks = [json.loads(line) for line in done.stdout.splitlines()]
    assert [t for c in chunks for t in c["token_ids"]] == want.token_ids
    assert chunks[-1]["finish_reason"] == pb.FinishReason.Name(pb.FINISH_REASON_LENGTH)
