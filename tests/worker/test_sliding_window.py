"""Sliding-window models keep only their window of KV: a sequence decoding past its window
holds at most ceil(window / block_size) + 1 blocks, generates past the size of the whole KV
pool, and its tokens still equal transformers' (whose own sliding-window cache is the
oracle). Blocks given back stay in the prefix cache."""

from __future__ import annotations

import random

import pytest
from headrace.sdk import GenerationConfig
from headrace.worker import LLM, Engine, EngineConfig

from tests.factories import build_checkpoint, hf_greedy

WINDOW = 8
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral-sw")
    return build_checkpoint(path, family="mistral", sliding_window=WINDOW)


def greedy(n: int) -> GenerationConfig:
    return GenerationConfig(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(length)]


def test_decoding_past_the_window_holds_at_most_its_window_of_blocks(mistral):
    prompts = [prompt_of(n, seed=n) for n in (5, 20, 33)]
    engine = Engine(EngineConfig(str(mistral), dtype="float32", block_size=BLOCK_SIZE))
    bm = engine.block_manager
    bound = -(-WINDOW // BLOCK_SIZE) + 1
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(40))
    max_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
        for seq in engine.scheduler.running:
            if seq.num_computed_tokens >= seq.num_prompt_tokens:  # decoding
                assert bm.num_held_blocks(seq) <= bound
                max_held = max(max_held, bm.num_held_blocks(seq))
    assert max_held == bound  # (the bound is reached: a new block opens at a block's end)
    assert [tokens[f"r{i}"] for i in range(3)] == hf_greedy(mistral, prompts, 40)
    assert bm.num_free_blocks == bm.num_blocks


def test_a_sequence_longer_than_the_whole_pool_generates_exactly(mistral):
    prompt = prompt_of(10)
    llm = LLM(str(mistral), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=6)
    result = llm.generate([prompt], greedy(50))[0]  # 60 tokens; the pool holds 24
    assert result.token_ids == hf_greedy(mistral, [prompt], 50)[0]
    assert llm.engine.scheduler.num_preemptions == 0


def test_blocks_given_back_are_still_served_from_the_prefix_cache(mistral):
    llm = LLM(str(mistral), dtype="float32", block_size=BLOCK_SIZE)
    prefix = prompt_of(24, seed=3)
    first, second = prefix + [11], prefix + [12, 13]
    llm.generate([first], greedy(12))  # decodes past the window: its prompt blocks dropped
    again = llm.generate([second], greedy(12))[0]
    assert again.usage.num_cached_tokens == 24
    assert again.token_ids == hf_greedy(mistral, [second], 12)[0]


def test_beams_of_a_windowed_model_fork_only_the_blocks_they_hold(mistral):
    llm = LLM(str(mistral), dtype="float32", block_size=BLOCK_SIZE)
    config = GenerationConfig(max_tokens=16, num_beams=3, ignore_eos=True, n=3)
    result = llm.generate([prompt_of(20, seed=4)], config)[0]
    assert len(result.outputs) == 3 and all(len(o.token_ids) == 16 for o in result.outputs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)


def test_speculating_past_the_window_keeps_accepted_and_trims_rejected_blocks(mistral):
    """Proposals' KV is written, then the rejected tail's blocks are trimmed while the
    blocks behind the window are given back: tokens still equal transformers'."""
    rng = random.Random(1)
    phrase = [rng.randrange(3, 200) for _ in range(4)]
    prompts = [phrase * 5, prompt_of(9, seed=9), prompt_of(23, seed=23)]
    llm = LLM(
        str(mistral),
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_speculative_tokens=3,
        speculative_max_seqs=8,
    )
    results = llm.generate(prompts, greedy(40))
    assert [r.token_ids for r in results] == hf_greedy(mistral, prompts, 40)
    stats = llm.engine.speculation
    assert 0 < stats.num_accepted < stats.num_proposed  # some kept, some trimmed
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
