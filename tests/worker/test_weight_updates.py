"""Live weight updates, pause modes and sleep, in-process (`LLM`, `AsyncEngine`).

Two random-weight checkpoints A and B of one shape: an engine serving A and then updated to B
must produce exactly `LLM(B)`'s tokens, carry B's version, and reuse no KV computed with A.
A rejected update must leave it serving A, unchanged.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from headrace.sdk import GenerationConfig, InvalidArgumentError, UnavailableError
from headrace.sdk.errors import InternalError
from headrace.sdk.outputs import FinishReason
from headrace.sdk.weights import GenerationState, PauseMode
from headrace.worker import LLM, AsyncEngine, EngineConfig
from headrace.worker.distributed.weight_sync import FromDisk, FromTensors
from safetensors.torch import load_file

from tests.factories import cached_checkpoint

PROMPTS: list[str | list[int]] = ["the quick brown fox", [5, 17, 42, 99, 7, 64, 23, 11] * 5]
GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = GenerationConfig(max_tokens=300, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints() -> tuple[Path, Path]:
    return cached_checkpoint("llama", seed=0), cached_checkpoint("llama", seed=1)


@pytest.fixture(scope="module")
def expected(checkpoints: tuple[Path, Path]) -> dict[str, list[list[int]]]:
    """Each checkpoint's own tokens for PROMPTS."""
    tokens = {}
    for name, path in zip("AB", checkpoints, strict=True):
        with LLM(str(path), dtype="float32") as llm:
            tokens[name] = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert tokens["A"] != tokens["B"]
    return tokens


def tensors_of(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(str(path / "model.safetensors")).items())


def tokens(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_an_llm_updated_from_disk_and_from_tensors_serves_exactly_the_new_weights(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]]
) -> None:
    a, b = checkpoints
    with LLM(str(a), dtype="float32") as llm:
        assert llm.weight_version() == "default"
        llm.update_weights(str(b), version="b-from-disk")
        results = llm.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in results] == expected["B"]
        assert {r.weight_version for r in results} == {"b-from-disk"}
        llm.update_weights_from_tensors(tensors_of(a), version="a-from-tensors")
        assert tokens(llm) == expected["A"]
        assert llm.weight_version() == "a-from-tensors"


def test_a_bf16_llm_updated_serves_the_new_weights_not_its_old_panels(
    checkpoints: tuple[Path, Path],
) -> None:
    """bf16 layers multiply by panels packed from their weights where the CPU makes them
    (`cpu_ops.panel_copy`): an update must repack them, or the engine would go on serving
    the old weights' tokens."""
    want = {}
    for name, path in zip("AB", checkpoints, strict=True):
        with LLM(str(path), dtype="bfloat16") as llm:
            want[name] = tokens(llm)
    assert want["A"] != want["B"]
    a, b = checkpoints
    with LLM(str(a), dtype="bfloat16") as llm:
        assert tokens(llm) == want["A"]  # the panels now hold A
        llm.update_weights(str(b), version="b-from-disk")
        assert tokens(llm) == want["B"]
        llm.update_weights_from_tensors(tensors_of(a), version="a-from-tensors")
        assert tokens(llm) == want["A"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shape", "model.layers.1.mlp.down_proj.weight: checkpoint tensor has shape (64, 100)"),
        ("missing", "missing weights: model.norm.weight"),
        ("unknown", "unexpected weights: model.layers.7.mlp.up_proj.weight"),
        ("dtype", "model.norm.weight: dtype torch.int64 is not a floating-point type"),
    ],
)
def test_a_rejected_update_names_the_tensor_and_changes_nothing(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]], change: str, message: str
) -> None:
    a, b = checkpoints
    named = dict(tensors_of(b))
    if change == "shape":
        named["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    elif change == "missing":
        del named["model.norm.weight"]
    elif change == "unknown":
        named["model.layers.7.mlp.up_proj.weight"] = torch.zeros(128, 64)
    else:
        named["model.norm.weight"] = named["model.norm.weight"].long()
    with LLM(str(a), dtype="float32") as llm:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)) as refused:
            llm.update_weights(named.items(), version="bad")
        assert refused.value.field == "weights"
        assert llm.weight_version() == "default"
        assert tokens(llm) == expected["A"]


def test_an_update_flushes_the_prefix_cache(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]]
) -> None:
    """KV computed with A is never reused for a prompt run after the update to B."""
    a, b = checkpoints
    with LLM(str(a), dtype="float32") as llm:
        tokens(llm)
        assert llm.generate(PROMPTS[1], GREEDY)[0].usage.num_cached_tokens > 0  # A's, cached
        llm.update_weights(str(b), version="b")
        result = llm.generate(PROMPTS[1], GREEDY)[0]
        assert result.usage.num_cached_tokens == 0
        assert result.token_ids == expected["B"][1]


def test_an_update_that_fails_while_copying_freezes_until_a_good_one(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]], monkeypatch
) -> None:
    """Checked whole and still failing partway (a disk error, say): the worker must not serve
    the mix, so it refuses requests until an update succeeds."""
    a, b = checkpoints
    with LLM(str(a), dtype="float32") as llm:
        model = llm.engine.runner.model
        real_load = model.load_weights

        def fail_halfway(tensors, complete=True):
            real_load(list(tensors)[:5], complete=False)
            raise OSError("disk went away")

        monkeypatch.setattr(model, "load_weights", fail_halfway)
        with pytest.raises(InternalError, match=r"failed after copying began.*disk went away"):
            llm.update_weights(str(b), version="b")
        assert llm.engine.control.state == GenerationState.WEIGHTS_INCOMPLETE
        with pytest.raises(UnavailableError, match="weights are incomplete"):
            llm.generate(PROMPTS, GREEDY)
        monkeypatch.setattr(model, "load_weights", real_load)
        llm.update_weights(str(b), version="b")
        assert tokens(llm) == expected["B"]


def test_sleep_releases_the_kv_cache_and_refuses_requests_until_wake_up(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]]
) -> None:
    a, _ = checkpoints
    with LLM(str(a), dtype="float32") as llm:
        llm.sleep()
        assert llm.engine.runner.kv_caches == []
        with pytest.raises(UnavailableError, match="asleep") as refused:
            llm.generate(PROMPTS, GREEDY)
        assert refused.value.retry_after_s is not None
        llm.wake_up()
        assert tokens(llm) == expected["A"]


def test_a_paused_llm_refuses_to_generate_until_resumed(
    checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]]
) -> None:
    with LLM(str(checkpoints[0]), dtype="float32") as llm:
        llm.pause("keep")
        with pytest.raises(UnavailableError, match="paused"):
            llm.generate(PROMPTS, GREEDY)
        with pytest.raises(InvalidArgumentError, match="mode: must be one of abort, wait, keep"):
            llm.pause("later")
        llm.resume()
        assert tokens(llm) == expected["A"]


# --- AsyncEngine: requests in flight across pauses and updates ---------------------------


@pytest.fixture
def engine(checkpoints: tuple[Path, Path]):
    engine = AsyncEngine(EngineConfig(str(checkpoints[0]), dtype="float32"))
    yield engine
    engine.shutdown()


async def run(engine: AsyncEngine, request_id: str, prompt, config=LONG):
    """(tokens, the version of each output, finish reason) of one request."""
    token_ids: list[int] = []
    versions: list[str] = []
    reason = None
    async for output in engine.generate(request_id, prompt, config):
        for delta in output.samples:
            token_ids.extend(delta.token_ids)
            reason = delta.finish_reason or reason
        versions.append(output.weight_version)
    return token_ids, versions, reason


async def started(engine: AsyncEngine, request_id: str, min_tokens: int = 3) -> None:
    """Wait until the request has generated a few tokens."""
    while True:
        request = engine.engine._requests.get(request_id)
        if request is not None and request.seqs[0].num_output_tokens >= min_tokens:
            return
        await asyncio.sleep(0.005)


def all_blocks_free(engine: AsyncEngine) -> bool:
    bm = engine.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.engine.has_unfinished_requests()


def a_prefix(checkpoint: Path, prompt, num_tokens: int) -> list[int]:
    config = GenerationConfig(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    with LLM(str(checkpoint), dtype="float32") as llm:
        return llm.generate([prompt], config)[0].token_ids


def test_keep_freezes_requests_which_continue_on_the_new_weights_after_resume(
    engine: AsyncEngine, checkpoints: tuple[Path, Path]
) -> None:
    a, b = checkpoints
    prompt = PROMPTS[1]

    async def main():
        request = asyncio.create_task(run(engine, "kept", prompt))
        await started(engine, "kept")
        await engine.pause_generation(PauseMode.KEEP)
        seq = engine.engine._requests["kept"].seqs[0]
        frozen_at, blocks = seq.num_output_tokens, list(seq.block_ids)
        await asyncio.sleep(0.3)
        assert seq.num_output_tokens == frozen_at and seq.block_ids == blocks  # KV kept
        assert engine.load.state == GenerationState.PAUSED
        await engine.update_weights(FromDisk(b), "b")
        await engine.resume_generation()
        return frozen_at, await request

    frozen_at, (token_ids, versions, reason) = asyncio.run(main())
    assert reason == FinishReason.LENGTH and len(token_ids) == LONG.max_tokens
    assert token_ids[:frozen_at] == a_prefix(a, prompt, frozen_at)  # A's tokens up to the pause
    assert versions[0] == "default" and versions[-1] == "b"
    assert versions == sorted(versions, key=["default", "b"].index)  # one switch, no mixing back
    assert all_blocks_free(engine)


def test_abort_ends_requests_with_their_prefix_and_new_ones_wait_for_resume(
    engine: AsyncEngine, checkpoints: tuple[Path, Path], expected: dict[str, list[list[int]]]
) -> None:
    a, b = checkpoints

    async def main():
        aborted = asyncio.create_task(run(engine, "aborted", PROMPTS[1]))
        await started(engine, "aborted")
        await engine.pause_generation(PauseMode.ABORT)
        token_ids, _, reason = await aborted
        assert reason == FinishReason.ABORT and 3 <= len(token_ids) < LONG.max_tokens
        assert token_ids == a_prefix(a, PROMPTS[1], len(token_ids))
        queued = asyncio.create_task(run(engine, "queued", PROMPTS[1], GREEDY))
        await asyncio.sleep(0.3)
        assert not queued.done() and engine.load.num_waiting_requests == 1
        await engine.update_weights(FromTensors(tuple(tensors_of(b))), "b")
        await engine.resume_generation()
        return await queued

    token_ids, versions, _ = asyncio.run(main())
    assert token_ids == expected["B"][1] and set(versions) == {"b"}
    assert all_blocks_free(engine)


def test_wait_returns_once_requests_in_flight_have_finished(engine: AsyncEngine) -> None:
    async def main():
        running = asyncio.create_task(run(engine, "running", PROMPTS[1], LONG))
        await started(engine, "running")
        await engine.pause_generation(PauseMode.WAIT)
        assert running.done()  # drained before the pause returned
        token_ids, _, reason = running.result()
        assert reason == FinishReason.LENGTH and len(token_ids) == LONG.max_tokens
        later = asyncio.create_task(run(engine, "later", PROMPTS[0], GREEDY))
        await asyncio.sleep(0.3)
        assert not later.done()
        await engine.resume_generation()
        await later

    asyncio.run(main())
    assert all_blocks_free(engine)


def test_a_reader_pause_and_a_keep_pause_never_release_each_other(engine: AsyncEngine) -> None:
    """The flow-control pause of one request (its reader fell behind) and a KEEP pause of
    generation hold independently: lifting one leaves the other in force."""

    async def main():
        request = asyncio.create_task(run(engine, "r", PROMPTS[1]))
        await started(engine, "r")
        engine.hold(["r"])  # the reader fell behind
        await engine.pause_generation(PauseMode.KEEP)
        await engine.resume_generation()
        await asyncio.sleep(0.3)
        seq = engine.engine._requests["r"].seqs[0]
        held_at = seq.num_output_tokens
        await asyncio.sleep(0.3)
        assert seq.num_output_tokens == held_at  # still held for its reader
        await engine.pause_generation(PauseMode.KEEP)
        engine.release(["r"])  # the reader caught up; generation is still paused
        await asyncio.sleep(0.3)
        assert seq.num_output_tokens == held_at
        await engine.resume_generation()
        return await request

    token_ids, _, reason = asyncio.run(main())
    assert reason == FinishReason.LENGTH and len(token_ids) == LONG.max_tokens


def test_sleep_aborts_requests_in_flight_and_wake_up_serves_again(
    engine: AsyncEngine, expected: dict[str, list[list[int]]]
) -> None:
    async def main():
        request = asyncio.create_task(run(engine, "r", PROMPTS[1]))
        await started(engine, "r")
        await engine.sleep()
        assert (await request)[2] == FinishReason.ABORT
        assert engine.load.state == GenerationState.ASLEEP
        with pytest.raises(UnavailableError, match="asleep"):
            await run(engine, "refused", PROMPTS[0], GREEDY)
        await engine.wake_up()
        return await run(engine, "after", PROMPTS[1], GREEDY)

    assert asyncio.run(main())[0] == expected["A"][1]
    assert all_blocks_free(engine)
