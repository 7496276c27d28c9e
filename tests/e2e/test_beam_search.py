"""Beam search over gRPC, end to end: a real worker (and a router in front of it) returns the
same beams as the offline `LLM`, each whole in one chunk with its scores; options beams
cannot honour are refused naming the field, and the worker carries on; a search whose worker
dies restarts whole on another one."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import wire
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import GenerationResult
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import (
    ServerProcess,
    load_report,
    two_workers_behind_a_router,
)

PROMPTS = ["the quick brown fox", "a story about the sea"]
CONFIGS = {
    "three_beams_best_two": GenerationConfig(max_tokens=12, temperature=0.0, n=2, num_beams=3),
    "never_stop_early_short_favoured": GenerationConfig(
        max_tokens=10, n=3, num_beams=4, length_penalty=-0.5, early_stopping="never"
    ),
}


def _target(request: pytest.FixtureRequest, server: str) -> str:
    target = request.getfixturevalue(server)
    return target if isinstance(target, str) else target.target


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("server", ["worker", "router"])
def test_beams_over_grpc_equal_the_offline_api(
    request: pytest.FixtureRequest, offline: LLM, server: str, name: str
) -> None:
    config = CONFIGS[name]
    expected = offline.generate(PROMPTS, config)
    with Client(_target(request, server)) as client:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            chunks = list(client.stream(prompt, config))
            beams = [c for c in chunks if c.token_ids]
            # Nothing streams before the search ends: one chunk per beam, best first.
            assert [c.index for c in beams] == list(range(config.n))
            assert chunks[-1].finished and chunks[-1].usage == want.usage
            got = client.generate(prompt, config)
            assert len(got.outputs) == len(want.outputs) == config.n
            for mine, theirs in zip(got.outputs, want.outputs, strict=True):
                assert mine.token_ids == theirs.token_ids
                assert mine.text == theirs.text
                assert mine.finish_reason == theirs.finish_reason
                assert theirs.beam_score is not None and theirs.cumulative_logprob is not None
                # float32 logprobs: another batch (offline, both prompts at once) moves the
                # last bits, and a score of -100 has a float32 spacing near 1e-5.
                assert mine.beam_score == pytest.approx(theirs.beam_score, rel=1e-5, abs=1e-5)
                assert mine.cumulative_logprob == pytest.approx(
                    theirs.cumulative_logprob, rel=1e-5, abs=1e-5
                )
            scores = [o.beam_score for o in got.outputs]
            assert scores == sorted(scores, reverse=True)


def test_a_beam_option_beams_cannot_honour_is_refused_and_the_worker_carries_on(
    worker: ServerProcess, offline: LLM
) -> None:
    """Built by hand: the SDK's own config would refuse it before sending."""
    bad = pb.Request(
        request_id="bad", text=PROMPTS[0], config=pb.GenerationConfig(num_beams=2, top_p=0.5)
    )
    good_config = CONFIGS["three_beams_best_two"]
    good = wire.request_to_wire("good", PROMPTS[0], good_config)
    messages = [pb.GenerateRequest(request=bad), pb.GenerateRequest(request=good)]
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        chunks = [c for r in stub.Generate(iter(messages), timeout=60) for c in r.chunks]
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.GenerateOne(bad, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("config.top_p: ")
    (refused,) = [c for c in chunks if c.request_id == "bad"]
    assert refused.finished and refused.error.field == "config.top_p"
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    beams = [c for c in chunks if c.request_id == "good" and c.token_ids]
    (want,) = offline.generate(PROMPTS[0], good_config)
    assert [list(c.token_ids) for c in beams] == [o.token_ids for o in want.outputs]
    assert all(c.HasField("beam_score") for c in beams)


def test_generate_command_prints_each_beam_with_its_score(
    worker: ServerProcess, offline: LLM
) -> None:
    config = GenerationConfig(max_tokens=8, temperature=0.0, n=2, num_beams=3, ignore_eos=True)
    (want,) = offline.generate(PROMPTS[0], config)
    flags = ["--target", worker.target, "--max-tokens", "8", "--ignore-eos"]
    flags += ["--num-beams", "3", "--n", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", "generate", *flags, "--raw", PROMPTS[0]],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == "".join(
        f"[beam {k}: score {o.beam_score:.4f}, cumulative logprob {o.cumulative_logprob:.4f}, "
        f"{len(o.token_ids)} tokens, finish: {o.finish_reason}]\n{o.text}\n"
        for k, o in enumerate(want.outputs)
    )
    assert b"16 tokens in" in done.stderr


def test_a_beam_search_whose_worker_dies_restarts_whole_elsewhere(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """n > 1 and still resumed: a beam search streamed nothing, so the router sends it again
    from its prompt, and the client gets exactly the beams of an undisturbed search."""
    config = GenerationConfig(max_tokens=300, temperature=0.0, n=2, num_beams=4, ignore_eos=True)
    prompts = [f"beams across a failover {i}" for i in range(4)]
    want = offline.generate(prompts, config)
    with two_workers_behind_a_router(tiny_model, tmp_path) as (router, _, b):
        got = asyncio.run(_generate_and_kill(router.target, b, prompts, config))
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in want
    ]
    assert all(o.beam_score is not None for r in got for o in r.outputs)
    assert (
        "resuming request" in (tmp_path / "router.log").read_text()
    )  # b's searches really moved to a


async def _generate_and_kill(
    target: str, victim: ServerProcess, prompts: list[str], config: GenerationConfig
) -> list[GenerationResult]:
    async with AsyncClient(target) as client:
        tasks = [asyncio.create_task(client.generate(p, config)) for p in prompts]
        while load_report(victim.target).running_requests == 0:
            await asyncio.sleep(0.01)  # nothing streams: ask the victim whether it is busy
        await asyncio.sleep(0.2)  # some decode steps into the search
        victim.proc.send_signal(signal.SIGKILL)
        return await asyncio.gather(*tasks)
