"""Quantized models end to end, against transformers over the same weights dequantized.

``quantization="int8"`` / ``"int4"`` quantize a float checkpoint's weights as they load; at one
rank headrace then computes with exactly ``dequantize(quantize(w))``, so transformers running a
checkpoint whose weights were replaced by those values is the oracle, and greedy tokens must
equal its tokens (llama, and qwen2's qkv bias; CPU C kernels and torch references; chunked
prefill and preemption). The same holds with a LoRA adapter on the quantized base (PEFT over
the dequantized base), for int4 split across two ranks (whole groups per rank), and after a
weight update with float tensors (the new checkpoint quantized as it lands).

A GGUF file is served as shipped (``quantization`` "auto" -> "gguf"): a tiny Llama GGUF written
as llama.cpp writes one (Q4_0 / Q4_1 projections, a Q8_0 vocabulary table, rows of q / k
interleaved) gives transformers' tokens for the same file, which transformers dequantizes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from headrace.kernels import quantized
from headrace.kernels.quantized import QuantizedWeight
from headrace.sdk import InvalidArgumentError
from headrace.worker import LLM, EngineConfig
from headrace.worker.models.store import CACHE_ENV
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.factories import (
    WEIGHT_STD,
    Family,
    build_checkpoint,
    build_tokenizer,
    hf_greedy,
    load_hf_model,
)
from tests.lora_factories import build_adapter, hf_lora_greedy
from tests.worker.test_engine_oracle import (
    COMPOSITIONS,
    assert_all_blocks_free,
    greedy,
    make_prompts,
)
from tests.worker.test_gguf import finish

MAX_TOKENS = 10
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: (bits, group size; None: one group per output row) of the projections.
PROJECTION_LAYOUTS = {"int8": (8, None), "int4": (4, quantized.INT4_GROUP_SIZE)}
#: The vocabulary table (embedding and LM head) is 8 bits per row under both, so the logits
#: keep their precision where the layers take 4.
VOCAB_LAYOUT = (8, None)
VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")
PROJECTION_WEIGHTS = {(module, "weight") for module in PROJECTIONS}  # biases stay float
#: transformers keeps a mixture's experts as one [experts, rows, columns] tensor per
#: projection; headrace quantizes each expert's matrix as a linear layer (routers stay float).
EXPERT_WEIGHTS = {("experts", "gate_up_proj"), ("experts", "down_proj")}


def layout_of(name: str, quantization: str) -> tuple[int, int | None] | None:
    """How headrace holds the checkpoint tensor ``name`` (None: as floats)."""
    if name in VOCAB_TABLES:
        return VOCAB_LAYOUT
    *_, module, kind = name.split(".")
    projection = (module, kind) in PROJECTION_WEIGHTS or (module, kind) in EXPERT_WEIGHTS
    return PROJECTION_LAYOUTS[quantization] if projection else None


def dequantized_checkpoint(path: Path, out: Path, quantization: str) -> Path:
    """``path``'s checkpoint with every tensor headrace quantizes replaced by
    ``dequantize(quantize(w))``, saved into ``out`` with the tokenizer."""
    model = load_hf_model(path)
    with torch.no_grad():
        for name, param in model.named_parameters():
            layout = layout_of(name, quantization)
            if layout is not None:
                bits, group_size = layout
                for matrix in param.view(-1, *param.shape[-2:]):  # each expert's, or the one
                    weight = quantized.quantize(matrix, bits, group_size or matrix.shape[1])
                    matrix.copy_(quantized.dequantize(weight))
    shutil.copytree(path, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    model.save_pretrained(out)
    return out


@dataclass(frozen=True)
class Case:
    #: The float checkpoint headrace loads and quantizes.
    path: Path
    #: The oracle's checkpoint: its weights dequantized.
    dequantized: Path
    prompts: list[list[int]]
    #: transformers' greedy tokens over the dequantized checkpoint.
    expected: list[list[int]]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory):
    """(family, quantization) -> its `Case`, built once per module."""
    paths: dict[Family, Path] = {}
    cases: dict[tuple[str, str], Case] = {}

    def case(family: Family, quantization: str) -> Case:
        if family not in paths:
            paths[family] = build_checkpoint(tmp_path_factory.mktemp(family), family=family)
        if (family, quantization) not in cases:
            out = tmp_path_factory.mktemp(f"{family}-{quantization}") / "dequantized"
            dequantized = dequantized_checkpoint(paths[family], out, quantization)
            prompts = make_prompts(256)
            expected = hf_greedy(dequantized, prompts, MAX_TOKENS)
            cases[family, quantization] = Case(paths[family], dequantized, prompts, expected)
        return cases[family, quantization]

    return case


def tokens_of(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts, greedy(MAX_TOKENS))]


# --- int8 / int4 against the oracle --------------------------------------------------------


@pytest.mark.parametrize("composition", ["chunked-8", "preempting"])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe"])
def test_greedy_tokens_equal_transformers_over_the_dequantized_weights(
    oracle, family: Family, quantization: str, backend: str, composition: str
) -> None:
    case = oracle(family, quantization)
    llm = LLM(
        str(case.path),
        dtype="float32",
        quantization=quantization,
        kernel_backend=backend,
        **COMPOSITIONS[composition],
    )
    assert backend == llm.engine.kernels.NAME
    assert tokens_of(llm, case.prompts) == case.expected
    if composition == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_oracle_is_not_the_float_model(oracle, quantization: str) -> None:
    """Quantizing changes some tokens: equality with the dequantized oracle is not vacuous."""
    case = oracle("llama", quantization)
    assert hf_greedy(case.path, case.prompts, MAX_TOKENS) != case.expected


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_each_prompt_alone_gets_the_tokens_it_gets_in_the_batch(oracle, quantization) -> None:
    case = oracle("llama", quantization)
    llm = LLM(
        str(case.path), dtype="float32", quantization=quantization, enable_prefix_caching=False
    )
    together = tokens_of(llm, case.prompts)
    alone = [tokens_of(llm, [prompt])[0] for prompt in case.prompts]
    assert alone == together == case.expected


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_two_tensor_parallel_ranks_equal_the_oracle(oracle, quantization: str) -> None:
    """int4's groups of 32 split cleanly across ranks (o_proj's 64 inputs and down_proj's 128
    are whole groups per rank); int8's per-channel scale is the whole row's on both ranks of
    a row-parallel layer (each rank quantizes the whole row, then keeps its columns). So the
    ranks hold exactly one rank's weights, split."""
    case = oracle("llama", quantization)
    options = dict(quantization=quantization, tensor_parallel_size=2, max_num_batched_tokens=16)
    with LLM(str(case.path), dtype="float32", **options) as llm:
        assert tokens_of(llm, case.prompts) == case.expected


def test_lora_on_an_int8_base_equals_peft_over_the_dequantized_base(oracle, tmp_path: Path) -> None:
    case = oracle("llama", "int8")
    adapter = build_adapter(case.path, tmp_path / "adapter", seed=1)
    expected = hf_lora_greedy(case.dequantized, adapter, case.prompts, MAX_TOKENS)
    assert expected != case.expected
    llm = LLM(
        str(case.path),
        dtype="float32",
        quantization="int8",
        lora_modules=(("a", str(adapter)),),
        max_num_batched_tokens=16,
    )
    prompts = case.prompts * 2  # each prompt with the adapter and without, in one batch
    adapters = ["a"] * len(case.prompts) + [None] * len(case.prompts)
    results = llm.generate(prompts, greedy(MAX_TOKENS), adapter=adapters)
    assert [r.token_ids for r in results] == expected + case.expected


def test_an_int4_model_updated_with_float_tensors_serves_the_new_checkpoint_at_int4(
    oracle, tmp_path: Path
) -> None:
    case = oracle("llama", "int4")
    new = build_checkpoint(tmp_path / "new", family="llama", seed=1)
    with LLM(str(new), dtype="float32", quantization="int4") as llm:
        expected = tokens_of(llm, case.prompts)
    assert expected != case.expected
    with LLM(str(case.path), dtype="float32", quantization="int4") as llm:
        assert tokens_of(llm, case.prompts) == case.expected
        llm.update_weights(load_file(str(new / "model.safetensors")).items(), version="new")
        assert tokens_of(llm, case.prompts) == expected


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied-head"])
def test_offloading_weights_moves_the_quantized_ones_too(tmp_path, monkeypatch, tied) -> None:
    """Sleep with weight offload (a GPU's) moves every weight, a quantized layer's integers,
    scales and offsets included, and wake-up brings them back. A CPU has no second device:
    here every quantized layer must be handed a copy made by `QuantizedWeight.moved` for the
    target (each once: a tied LM head keeps sharing its table), and the tokens kept."""
    path = build_checkpoint(tmp_path, family="llama", tie_word_embeddings=tied)
    with LLM(str(path), dtype="float32", quantization="int4") as llm:
        prompts = make_prompts(llm.engine.vocab_size)
        expected = tokens_of(llm, prompts)
        runner = llm.engine.runner
        model = runner.model
        before = {name: m.quantized for name, m in model.named_modules() if _quantized(m)}
        assert len(before) == 2 + 4 * model.num_layers  # embedding, LM head, 4 a layer
        shared = [(a, b) for a in before for b in before if a < b and before[a] is before[b]]
        assert bool(shared) == tied
        copies: list[QuantizedWeight] = []
        real_moved = QuantizedWeight.moved

        def moved(weight: QuantizedWeight, place: Callable) -> QuantizedWeight:
            copies.append(real_moved(weight, place))
            assert all(t.device == torch.device("cpu") for t in copies[-1].tensors())
            return copies[-1]

        monkeypatch.setattr(QuantizedWeight, "moved", moved)
        runner.move_weights(torch.device("cpu"))
        after = {name: m.quantized for name, m in model.named_modules() if _quantized(m)}
        assert after.keys() == before.keys()
        assert all(any(after[name] is c for c in copies) for name in after)
        assert all(after[a] is after[b] for a, b in shared)
        assert len(copies) == len({id(w) for w in before.values()})  # each moved once
        assert tokens_of(llm, prompts) == expected


def _quantized(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "quantized", None), QuantizedWeight)


# --- a GGUF as shipped -----------------------------------------------------------------------

Q = GGMLQuantizationType
GGUF_HIDDEN, GGUF_FFN, GGUF_LAYERS, GGUF_HEADS, GGUF_KV_HEADS = 64, 128, 2, 4, 2
#: GGUF block name -> (type, torch shape [N, K]) of each layer's tensors, as llama.cpp's
#: Q4_0 / Q4_1 files hold them (norms in float32).
GGUF_LAYER_TENSORS = {
    "attn_norm": (Q.F32, (GGUF_HIDDEN,)),
    "attn_q": (Q.Q4_1, (GGUF_HIDDEN, GGUF_HIDDEN)),
    "attn_k": (Q.Q4_1, (GGUF_HIDDEN * GGUF_KV_HEADS // GGUF_HEADS, GGUF_HIDDEN)),
    "attn_v": (Q.Q4_0, (GGUF_HIDDEN * GGUF_KV_HEADS // GGUF_HEADS, GGUF_HIDDEN)),
    "attn_output": (Q.Q4_1, (GGUF_HIDDEN, GGUF_HIDDEN)),
    "ffn_norm": (Q.F32, (GGUF_HIDDEN,)),
    "ffn_gate": (Q.Q4_0, (GGUF_FFN, GGUF_HIDDEN)),
    "ffn_up": (Q.Q4_1, (GGUF_FFN, GGUF_HIDDEN)),
    "ffn_down": (Q.Q4_0, (GGUF_HIDDEN, GGUF_FFN)),
}


def write_llama_gguf(path: Path) -> Path:
    """A tiny Llama GGUF with random weights and `build_tokenizer`'s BPE as a "gpt2"
    tokenizer, its metadata named as llama.cpp's converter names it."""
    tokenizer = build_tokenizer(path.parent / "tokenizer")
    merges = json.loads((path.parent / "tokenizer" / "tokenizer.json").read_text())["model"]
    vocab_size = len(tokenizer)
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(GGUF_HIDDEN)
    writer.add_feed_forward_length(GGUF_FFN)
    writer.add_block_count(GGUF_LAYERS)
    writer.add_head_count(GGUF_HEADS)
    writer.add_head_count_kv(GGUF_KV_HEADS)
    writer.add_rope_dimension_count(GGUF_HIDDEN // GGUF_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokenizer.convert_ids_to_tokens(list(range(vocab_size))))
    special = set(tokenizer.all_special_ids)
    writer.add_token_types([3 if i in special else 1 for i in range(vocab_size)])  # 3: control
    writer.add_token_merges([" ".join(pair) for pair in merges["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    tensors: dict[str, tuple[Q, tuple[int, ...]]] = {
        "token_embd.weight": (Q.Q8_0, (vocab_size, GGUF_HIDDEN))
    }
    for layer in range(GGUF_LAYERS):
        for name, spec in GGUF_LAYER_TENSORS.items():
            tensors[f"blk.{layer}.{name}.weight"] = spec
    tensors["output_norm.weight"] = (Q.F32, (GGUF_HIDDEN,))
    tensors["output.weight"] = (Q.Q8_0, (vocab_size, GGUF_HIDDEN))
    rng = np.random.default_rng(0)
    for name, (qtype, shape) in tensors.items():
        noise = rng.standard_normal(shape, dtype=np.float32)
        values = 1.0 + 0.2 * noise if len(shape) == 1 else WEIGHT_STD * noise
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    finish(writer)
    return path


def transformers_checkpoint(gguf_path: Path, out: Path) -> Path:
    """transformers' own model of the GGUF (every tensor dequantized, q / k rows restored),
    saved as a plain checkpoint (a GGUF-loaded model refuses `save_pretrained`)."""
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    return out


def test_a_gguf_is_served_as_shipped_with_transformers_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "gguf" / "tiny.gguf")
    prompts = make_prompts(256)
    expected = hf_greedy(transformers_checkpoint(path, tmp_path / "oracle"), prompts, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.spec.quantization == "gguf-q4"  # the file's projections are Q4_0 / Q4_1
    model: Any = llm.engine.runner.model
    held = [getattr(module, "quantized", None) for module in model.modules()]
    # qkv, o, gate_up and down of each layer hold the file's Q4_0 / Q4_1 blocks.
    assert sum(isinstance(w, QuantizedWeight) and w.bits == 4 for w in held) == 4 * GGUF_LAYERS
    assert tokens_of(llm, prompts) == expected


# --- errors ----------------------------------------------------------------------------------


def test_gguf_quantization_of_a_checkpoint_folder_is_refused_naming_the_field(oracle) -> None:
    with pytest.raises(InvalidArgumentError, match="GGUF file") as error:
        LLM(str(oracle("llama", "int8").path), dtype="float32", quantization="gguf")
    assert error.value.field == "quantization"


@pytest.mark.parametrize("value", ["int3", "INT8", "q4_k"])
def test_an_unknown_quantization_is_refused_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidArgumentError, match="auto, none, int8, int4, gguf") as error:
        EngineConfig("unused", quantization=value)
    assert error.value.field == "quantization"


def test_int4_refuses_a_layer_whose_inputs_are_not_whole_groups(tmp_path: Path) -> None:
    """down_proj's 80 inputs are not groups of 32: refused at start-up, naming the sizes. (So
    is a rank's share of a row-parallel layer: 96 inputs over two ranks are 48 each.)"""
    path = build_checkpoint(tmp_path, "llama", intermediate_size=80)
    with pytest.raises(InvalidArgumentError, match=r"down_proj.*rows of 80 are not") as error:
        LLM(str(path), dtype="float32", quantization="int4")
    assert error.value.field == "quantization"
