"""A constrained request survives a worker's kill -9 through the router: the router resumes
it elsewhere as prompt + tokens so far with `num_resumed_tokens`, the new worker advances the
grammar over those tokens, and every stream finishes exactly as it does without a failure,
its output valid under the schema. The fields also work straight through gRPC."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import jsonschema
import pytest
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.launch import ServerProcess
from headrace.sdk.outputs import FinishReason
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import load_report, two_workers_behind_a_router

pytestmark = pytest.mark.timeout(300)

#: Long enough (about 40 tokens) to be cut mid-way, and always finished by the grammar.
WORDS = {
    "type": "array",
    "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    "minItems": 12,
    "maxItems": 12,
}
NUM_STREAMS = 24


def _configs() -> list[GenerationConfig]:
    return [
        GenerationConfig(max_tokens=200, temperature=0.0, json_schema=WORDS)
        if i % 2 == 0
        else GenerationConfig(max_tokens=200, temperature=0.9, seed=i, json_schema=WORDS)
        for i in range(NUM_STREAMS)
    ]


def test_a_constrained_stream_survives_a_worker_kill(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    prompts = [f"constrained failover {i}" for i in range(NUM_STREAMS)]
    configs = _configs()
    want = [r.token_ids for r in offline.generate(prompts, configs)]  # type: ignore[arg-type]
    with two_workers_behind_a_router(tiny_model, tmp_path) as (router, _, b):
        got, texts, reasons = asyncio.run(_stream_and_kill(router, b, prompts, configs))
    assert got == want
    for text in texts:
        jsonschema.validate(json.loads(text), WORDS)
    assert reasons == [FinishReason.STOP] * NUM_STREAMS
    assert (
        "resuming request" in (tmp_path / "router.log").read_text()
    )  # b's streams really moved to a


async def _stream_and_kill(
    router: ServerProcess, victim: ServerProcess, prompts: list[str], configs: list
) -> tuple[list[list[int]], list[str], list]:
    async with AsyncClient(router.target) as client:
        tokens: dict[int, list[int]] = {i: [] for i in range(NUM_STREAMS)}
        texts = [""] * NUM_STREAMS
        reasons: list = [None] * NUM_STREAMS

        async def one(i: int) -> None:
            async for chunk in client.stream(prompts[i], configs[i]):
                tokens[i].extend(chunk.token_ids)
                texts[i] += chunk.text
                reasons[i] = chunk.finish_reason or reasons[i]

        tasks = [asyncio.create_task(one(i)) for i in range(NUM_STREAMS)]
        while sum(map(len, tokens.values())) < NUM_STREAMS * 8:
            await asyncio.sleep(0.005)
        assert load_report(victim.target).running_requests > 0  # the victim is mid-generation
        victim.proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
    return [tokens[i] for i in range(NUM_STREAMS)], texts, reasons


def test_constraints_and_controls_through_grpc(worker: ServerProcess, offline: LLM) -> None:
    config = GenerationConfig(max_tokens=8, temperature=0.0, choice=("left", "right"))
    biased = GenerationConfig(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={9: 100})
    with Client(worker.target) as client:
        picked = client.generate("Which way?", config)
        assert picked.text in ("left", "right")
        assert picked.text == offline.generate("Which way?", config)[0].text
        assert client.generate("Which way?", biased).token_ids == [9, 9, 9, 9]
        with pytest.raises(InvalidArgumentError) as refused:
            client.generate("Which way?", GenerationConfig(regex="(unclosed"))
    assert refused.value.field == "config.regex"
