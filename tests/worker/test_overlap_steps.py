"""Overlapped steps (`EngineConfig.overlap_steps`): each step's forward runs on the device
thread while the engine samples and plans another step over other sequences. Their tokens
against the oracle are in test_engine_oracle (the "overlapped" compositions); here, what the
thread changes: where the work runs, faults, and shutting down."""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker import Engine, EngineConfig

from tests.factories import cached_checkpoint, hf_greedy

MAX_TOKENS = 6


def greedy() -> GenerationConfig:
    return GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (2, 5, 8, 11, 14, 17)]


def run(engine: Engine, requests: list[list[int]]) -> dict[str, Any]:
    """Every request to its end: request id -> (tokens, finish reason, error)."""
    for i, prompt in enumerate(requests):
        engine.add_request(f"r{i}", prompt, greedy())
    tokens: dict[str, list[int]] = {}
    ends: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    ends[output.request_id] = (delta.finish_reason, output.error)
    return {rid: (tokens.get(rid, []), *ends[rid]) for rid in ends}


def test_forwards_run_on_the_device_thread_two_steps_in_flight():
    path = cached_checkpoint(family="llama")
    engine = Engine(EngineConfig(str(path), dtype="float32", overlap_steps=True))
    forward = engine.runner.forward
    threads: set[int] = set()

    def recording(*args: Any) -> Any:
        threads.add(threading.get_ident())
        return forward(*args)

    engine.runner.forward = recording  # type: ignore[method-assign]
    requests = prompts(engine.vocab_size)
    for i, prompt in enumerate(requests):
        engine.add_request(f"r{i}", prompt, greedy())
    engine.step()
    assert len(engine._in_flight) == 1  # submitted, not collected: the device may run it
    first = {c.seq.request_id for c in engine.last_step.chunks}  # type: ignore[union-attr]
    second = {c.seq.request_id for c in engine._in_flight[0].step.chunks}
    assert first and second and not first & second  # the two halves of the sequences
    engine.settle()
    assert threads and threading.get_ident() not in threads
    engine.close()
    assert engine.executor.device_thread is None


def test_a_fault_on_the_device_thread_fails_that_steps_requests_only():
    path = cached_checkpoint(family="llama")
    engine = Engine(EngineConfig(str(path), dtype="float32", overlap_steps=True))
    requests = prompts(engine.vocab_size)
    expected = hf_greedy(path, requests, MAX_TOKENS)
    runner = engine.runner
    prepare, run_batch = runner.prepare, runner.run
    request_ids: dict[int, set[str]] = {}  # batch id -> its requests, noted as it is built
    faulted: set[str] = set()
    runs = 0

    def noting(chunks: Any) -> Any:
        batch = prepare(chunks)
        request_ids[id(batch)] = {c.seq.request_id for c in chunks}
        return batch

    def faulty(block_copies: Any, batch: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 3:  # a step past the first prefills, while another is in flight
            faulted.update(request_ids[id(batch)])
            raise RuntimeError("device fault")
        return run_batch(block_copies, batch)

    runner.prepare, runner.run = noting, faulty  # type: ignore[method-assign]
    results = run(engine, requests)
    assert faulted and len(faulted) < len(requests)
    for i in range(len(requests)):
        tokens, reason, error = results[f"r{i}"]
        if f"r{i}" in faulted:
            assert reason == FinishReason.ERROR and "device fault" in str(error)
        else:
            assert (tokens, reason, error) == (expected[i], FinishReason.LENGTH, None)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


@pytest.mark.parametrize("other", [dict(tensor_parallel_size=2), dict(enable_lora=True)])
def test_overlap_steps_is_refused_with_several_ranks_or_lora(other):
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", overlap_steps=True, **other)
    assert info.value.field == "overlap_steps"
