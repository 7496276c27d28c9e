"""Int8 activations end to end (``int8_activations=True``, ``--int8-activations``).

Quantized layers and the quantized LM head multiply activations rounded to int8 per block of
32, so the float oracle's tokens no longer bind (that they differ is checked, so the
equalities are not vacuous); the reference kernels running each prompt alone are the oracle,
as for the int8 KV cache: every batch composition of the engine's matrix on the C kernels and
on the references gives each prompt those tokens, for int4 weights quantized at load, and
some compositions for int8 ones and W4A16 / W8A16 compressed-tensors checkpoints, with the KV
cache in int8 too. The flag is refused, naming it, where the layers are float, and on the
Triton kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from headrace.sdk import InvalidArgumentError
from headrace.worker import LLM

from tests.factories import build_checkpoint
from tests.worker.test_compressed_tensors import Scheme, compress
from tests.worker.test_engine_oracle import (
    COMPOSITIONS,
    assert_all_blocks_free,
    greedy,
    make_prompts,
)

MAX_TOKENS = 12
A8 = dict(dtype="float32", int8_activations=True)


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, greedy(MAX_TOKENS))]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), family="llama")


@pytest.fixture(scope="module")
def case(float_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """model kind -> (path, engine options, prompts, each prompt's reference tokens alone)."""
    cases: dict[str, tuple] = {}

    def make(kind: str) -> tuple:
        if kind not in cases:
            if kind in ("int4", "int8"):
                path, options = float_dir, dict(quantization=kind)
            else:  # "w4a16", "w8a16"
                out = tmp_path_factory.mktemp(kind) / "ckpt"
                path, options = compress(float_dir, out, Scheme(int(kind[1]), 32)), {}
            llm = LLM(str(path), kernel_backend="reference", enable_prefix_caching=False,
                      **options, **A8)  # fmt: skip
            prompts = make_prompts(llm.engine.vocab_size)
            alone = [tokens_of(llm, [prompt])[0] for prompt in prompts]
            cases[kind] = (path, options, prompts, alone)
        return cases[kind]

    return make


MATRIX = [("int4", composition, "cpu") for composition in sorted(COMPOSITIONS)] + [
    ("int4", "chunked-8", "reference"),
    ("int4", "preempting", "reference"),
    ("int8", "chunked-8", "cpu"),
    ("int8", "preempting", "cpu"),
    ("int8", "chunked-8", "reference"),
    ("w4a16", "chunked-8", "cpu"),
    ("w4a16", "preempting", "cpu"),
    ("w8a16", "chunked-8", "cpu"),
]


@pytest.mark.parametrize(("kind", "composition", "backend"), MATRIX)
def test_every_composition_gives_each_prompt_its_tokens_alone(case, kind, composition, backend):
    path, options, prompts, expected = case(kind)
    llm = LLM(str(path), kernel_backend=backend, **options, **COMPOSITIONS[composition], **A8)
    assert tokens_of(llm, prompts) == expected
    if "preempting" in composition:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_with_the_kv_cache_in_int8_too(case):
    path, options, prompts, _ = case("int4")
    reference = LLM(str(path), kernel_backend="reference", kv_cache_dtype="int8", **options, **A8)
    fused = LLM(str(path), max_num_batched_tokens=8, kv_cache_dtype="int8", **options, **A8)
    assert tokens_of(fused, prompts) == [tokens_of(reference, [p])[0] for p in prompts]


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_the_oracle_is_not_the_exact_quantized_model(case, kind):
    path, options, prompts, expected = case(kind)
    assert tokens_of(LLM(str(path), dtype="float32", **options), prompts) != expected


def test_the_lm_head_multiplies_int8_activations_too(float_dir):
    llm = LLM(str(float_dir), quantization="int4", **A8)
    head = llm.engine.runner.model.lm_head.quantized
    assert head is not None and head.bits == 8 and head.int8_activations


def test_with_float_layers_it_is_refused_naming_the_field(float_dir):
    with pytest.raises(InvalidArgumentError, match="not none") as error:
        LLM(str(float_dir), quantization="none", **A8)
    assert error.value.field == "int8_activations"


def test_the_triton_kernels_refuse_it(float_dir):
    with pytest.raises(InvalidArgumentError, match="not triton") as error:
        LLM(str(float_dir), quantization="int4", kernel_backend="triton", **A8)
    assert error.value.field == "int8_activations"


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_two_tensor_parallel_ranks_give_each_prompt_its_tokens_alone(case, kind):
    """A rank rounds x over its own columns of a row-parallel layer; the blocks of 32 fall
    within a rank's columns, so x is rounded as on one rank, and only the order of the
    partial sums (the all-reduce) differs."""
    path, options, prompts, expected = case(kind)
    llm = LLM(str(path), tensor_parallel_size=2, max_num_batched_tokens=16, **options, **A8)
    try:
        assert tokens_of(llm, prompts) == expected
    finally:
        llm.engine.close()
