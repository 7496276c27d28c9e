"""The int8 KV cache end to end (``kv_cache_dtype="int8"``).

Quantizing K and V changes the model's arithmetic, so transformers is no oracle here; the
reference kernels running each prompt alone are (as the quantization issue sets it): every
batch composition of the engine oracle's matrix (chunked prefill, one-token blocks, preemption,
overlapped steps, prefix reuse), on the C kernels, the torch references and Triton, gives each
prompt the tokens it gets alone. Each (token, head) row is quantized on its own, so nothing
about a batch can reach a row's bits. That the oracle is not the float model's tokens is
checked, so the equality is not vacuous; beams that fork mid-block copy int8 blocks whole;
the same memory holds (D + 4) / (4 D) as many
float32 blocks' worth, two tensor-parallel ranks (each caching its own heads) equal one, and
an unknown value is refused naming the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM, EngineConfig
from transformers import AutoConfig

from tests.factories import build_checkpoint
from tests.worker.test_engine_oracle import (
    COMPOSITIONS,
    assert_all_blocks_free,
    greedy,
    make_prompts,
)

INT8 = dict(dtype="float32", kv_cache_dtype="int8")
MAX_TOKENS = 12


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, greedy(MAX_TOKENS))]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, each prompt's tokens alone on the reference kernels at int8 KV)."""
    path = build_checkpoint(tmp_path_factory.mktemp("llama"), family="llama")
    llm = LLM(str(path), kernel_backend="reference", enable_prefix_caching=False, **INT8)
    prompts = make_prompts(llm.engine.vocab_size)
    return path, prompts, [tokens_of(llm, [prompt])[0] for prompt in prompts]


MATRIX = [(composition, "cpu") for composition in sorted(COMPOSITIONS)] + [
    ("chunked-8", "reference"),
    ("preempting", "reference"),
    ("chunked-8", "triton"),
]


@pytest.mark.parametrize(("composition", "backend"), MATRIX)
def test_every_composition_gives_each_prompt_its_tokens_alone(case, composition, backend):
    path, prompts, expected = case
    llm = LLM(str(path), kernel_backend=backend, **COMPOSITIONS[composition], **INT8)
    assert backend == llm.engine.kernels.NAME
    assert tokens_of(llm, prompts) == expected
    if "preempting" in composition:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_the_oracle_is_not_the_float_cache(case):
    path, prompts, expected = case
    assert tokens_of(LLM(str(path), dtype="float32"), prompts) != expected


def test_reused_prefix_blocks_give_the_same_tokens(case):
    """The second round finds the first round's blocks in the prefix cache (int8 rows reused
    as they are) and gets the same tokens."""
    path, prompts, expected = case
    llm = LLM(str(path), block_size=4, **INT8)
    assert tokens_of(llm, prompts) == expected
    hits_before = llm.engine.block_manager.num_prefix_hit_blocks
    assert tokens_of(llm, prompts) == expected
    assert llm.engine.block_manager.num_prefix_hit_blocks > hits_before
    assert_all_blocks_free(llm.engine)


def test_forked_beams_copy_int8_blocks_whole(case):
    """Beams forking mid-block (block size 4) copy the shared int8 block, values and scales,
    before writing: the beams equal those of the same search on the reference kernels in
    blocks of 16, alone, and the batch's other requests keep their tokens."""
    path, prompts, expected = case
    beams = GenerationConfig(max_tokens=8, temperature=0.0, num_beams=3, n=3, ignore_eos=True)
    alone = LLM(str(path), kernel_backend="reference", **INT8).generate([prompts[3]], beams)[0]
    llm = LLM(str(path), block_size=4, **INT8)
    copies: list[tuple[int, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        step = schedule(*args, **kwargs)
        copies.extend(step.block_copies)
        return step

    llm.engine.scheduler.schedule = recording  # type: ignore[method-assign]
    batch = llm.generate(prompts, [greedy(MAX_TOKENS)] * 3 + [beams] + [greedy(MAX_TOKENS)] * 2)
    assert [c.token_ids for c in batch[3].outputs] == [c.token_ids for c in alone.outputs]
    others = [r.token_ids for i, r in enumerate(batch) if i != 3]
    assert others == [t for i, t in enumerate(expected) if i != 3]
    assert copies  # the forks did copy blocks
    assert_all_blocks_free(llm.engine)


def test_two_tensor_parallel_ranks_equal_one(case):
    path, prompts, expected = case
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **INT8)
    try:
        assert tokens_of(llm, prompts) == expected
    finally:
        llm.close()


def test_the_same_memory_holds_more_blocks(case):
    """A block of int8 rows costs (D + 4) bytes per (token, head) where float32 costs 4 D."""
    path, _, _ = case
    hf = AutoConfig.from_pretrained(path)
    heads, layers = hf.num_key_value_heads, hf.num_hidden_layers
    head_dim = hf.hidden_size // hf.num_attention_heads
    gib = 0.001
    budget: dict[str, Any] = dict(dtype="float32", cpu_kv_cache_gib=gib, max_num_seqs=1024)
    blocks = {}
    for kind, row_bytes in (("auto", 4 * head_dim), ("int8", head_dim + 4)):
        engine = LLM(str(path), kv_cache_dtype=kind, **budget).engine
        blocks[kind] = engine.block_manager.num_blocks
        assert blocks[kind] == int(gib * 2**30) // (layers * 2 * 16 * heads * row_bytes)
    ratio = blocks["int8"] / blocks["auto"]
    assert math.isclose(ratio, 4 * head_dim / (head_dim + 4), rel_tol=0.02)


@pytest.mark.parametrize("value", ["fp8", "INT8", "int4"])
def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        EngineConfig("unused", kv_cache_dtype=value)
    assert error.value.field == "kv_cache_dtype" and value in str(error.value)
