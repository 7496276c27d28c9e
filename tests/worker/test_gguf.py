"""GGUF tensors read as shipped: each dequantizes to exactly what gguf-py and transformers give.

A synthetic Llama GGUF holds every format the reader distinguishes (three kept quantized,
three float types, two dequantized); the shipped SmolLM2 GGUF is checked tensor by tensor
against transformers' own GGUF loader, which also undoes llama.cpp's q / k row permutation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from headrace.kernels.quantized import QuantizedWeight, dequantize
from headrace.sdk.errors import NotFoundError
from headrace.worker.models import gguf as gguf_module
from headrace.worker.models import store
from headrace.worker.models.gguf import gguf_source, iter_gguf_tensors
from headrace.worker.models.store import (
    CACHE_ENV,
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ROUND_TRIP_TEXT,
    gguf_dir,
    gguf_file,
    is_prepared,
    read_config_and_tokenizer,
    resolve_model,
)
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

Q = GGMLQuantizationType
NUM_HEADS, NUM_KV_HEADS, HIDDEN, FFN, VOCAB = 4, 2, 64, 96, 48

#: GGUF name -> (type, torch shape [N, K]).
SYNTHETIC = {
    "token_embd.weight": (Q.BF16, (VOCAB, HIDDEN)),
    "blk.0.attn_norm.weight": (Q.F32, (HIDDEN,)),
    "blk.0.attn_q.weight": (Q.Q4_1, (HIDDEN, HIDDEN)),
    "blk.0.attn_k.weight": (Q.Q8_0, (HIDDEN // 2, HIDDEN)),
    "blk.0.attn_v.weight": (Q.Q4_0, (HIDDEN // 2, HIDDEN)),
    "blk.0.attn_output.weight": (Q.Q5_0, (HIDDEN, HIDDEN)),
    "blk.0.ffn_norm.weight": (Q.F16, (HIDDEN,)),
    "blk.0.ffn_gate.weight": (Q.Q5_1, (FFN, HIDDEN)),
    "blk.0.ffn_up.weight": (Q.Q8_0, (FFN, HIDDEN)),
    "blk.0.ffn_down.weight": (Q.Q4_0, (HIDDEN, FFN)),
    "output_norm.weight": (Q.F32, (HIDDEN,)),
    "output.weight": (Q.Q4_1, (VOCAB, HIDDEN)),
}
SMOLLM2 = KNOWN_MODELS[DEFAULT_MODEL]


def write_gguf(
    path: Path, tensors: Mapping[str, tuple[Q, tuple[int, ...]]], architecture: str = "llama"
) -> Path:
    """A GGUF of random tensors quantized by gguf-py, with Llama's head counts."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    for name, (qtype, shape) in tensors.items():
        values = rng.standard_normal(shape, dtype=np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    finish(writer)
    return path


def finish(writer: GGUFWriter) -> None:
    """Write the header, metadata and tensors a GGUFWriter was given, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def as_float(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight.float()


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "synthetic.gguf", SYNTHETIC)


def gguf_py_reference(path: Path) -> dict[str, torch.Tensor]:
    """gguf-py's dequantization of every tensor, q / k un-permuted as transformers does."""
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS}
    )
    reference = {}
    for tensor in GGUFReader(path).tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = processor.process(weights=values, name=tensor.name).weights
        reference[gguf_module.hf_name(tensor.name)] = torch.from_numpy(np.array(values))
    return reference


# -- the formats ----------------------------------------------------------------------------


def test_every_format_dequantizes_to_gguf_py_exactly(synthetic: Path) -> None:
    reference = gguf_py_reference(synthetic)
    ours = dict(iter_gguf_tensors(synthetic))
    assert ours.keys() == reference.keys()
    for name, weight in ours.items():
        assert torch.equal(as_float(weight), reference[name]), name


def test_q8_0_q4_0_q4_1_stay_quantized_and_floats_keep_their_dtype(synthetic: Path) -> None:
    ours = dict(iter_gguf_tensors(synthetic))
    q8 = ours["model.layers.0.mlp.up_proj.weight"]
    q4_0 = ours["model.layers.0.mlp.down_proj.weight"]
    q4_1 = ours["lm_head.weight"]
    assert isinstance(q8, QuantizedWeight) and (q8.bits, q8.group_size) == (8, 32)
    assert q8.data.dtype == torch.int8 and q8.offsets is None
    assert isinstance(q4_0, QuantizedWeight) and q4_0.shape == (HIDDEN, FFN)
    assert q4_0.offsets is not None and torch.equal(q4_0.offsets, -8 * q4_0.scales)
    assert isinstance(q4_1, QuantizedWeight) and q4_1.data.shape == (VOCAB, HIDDEN // 2)
    dtypes = {
        "model.embed_tokens.weight": torch.bfloat16,
        "model.layers.0.post_attention_layernorm.weight": torch.float16,
        "model.norm.weight": torch.float32,
        "model.layers.0.self_attn.o_proj.weight": torch.float32,  # Q5_0, dequantized
    }
    for name, dtype in dtypes.items():
        weight = ours[name]
        assert isinstance(weight, torch.Tensor) and weight.dtype == dtype, name


def test_dequantized_types_are_logged_once_per_file(
    synthetic: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=gguf_module.__name__):
        list(iter_gguf_tensors(synthetic))
    [record] = caplog.records
    assert "synthetic.gguf: Q5_0, Q5_1 tensors dequantized" in record.getMessage()


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "gpt2.gguf", {"output.weight": (Q.F32, (4, 32))}, "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        next(iter_gguf_tensors(path))


def test_unknown_tensor_names_are_refused_before_any_is_yielded(tmp_path: Path) -> None:
    tensors = {"output.weight": (Q.F32, (4, 32)), "blk.0.attn_qkv.weight": (Q.F32, (4, 32))}
    with pytest.raises(ValueError, match=r"'blk\.0\.attn_qkv\.weight' has no Hugging Face"):
        next(iter_gguf_tensors(write_gguf(tmp_path / "fused.gguf", tensors)))


# -- the shipped model ----------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_dequantized_checkpoint() -> None:
    from transformers import AutoModelForCausalLM

    path = store.locate_gguf(SMOLLM2)
    config, _ = read_config_and_tokenizer(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    expected: dict[str, torch.Tensor] = loaded["tensors"]
    num_quantized = 0
    for name, weight in iter_gguf_tensors(path):
        num_quantized += isinstance(weight, QuantizedWeight)
        assert torch.equal(as_float(weight), expected.pop(name)), name
    assert not expected, f"not read: {sorted(expected)}"
    assert num_quantized == 1 + 30 * 7  # the Q8_0 embedding, every projection in Q4_1


# -- the folder and the store ---------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a .gguf path to SmolLM2's file, the folder resolve_model prepared for it)."""
    root = tmp_path_factory.mktemp("gguf-cache")
    link = root / "smollm2.gguf"
    link.symlink_to(store.locate_gguf(SMOLLM2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(root / "cache"))
        return link, resolve_model(str(link))


def test_gguf_folder_has_the_gguf_config_and_no_weights(served: tuple[Path, Path]) -> None:
    from transformers import AutoConfig

    link, folder = served
    config = AutoConfig.from_pretrained(folder)
    reader = GGUFReader(link)

    def field(key: str) -> int:
        return int(reader.fields[f"llama.{key}"].parts[-1][0])

    assert config.model_type == "llama"
    assert config.hidden_size == field("embedding_length") == 576
    assert config.num_hidden_layers == field("block_count")
    assert config.num_attention_heads == field("attention.head_count")
    assert config.num_key_value_heads == field("attention.head_count_kv")
    assert config.intermediate_size == field("feed_forward_length")
    assert config.tie_word_embeddings
    assert (folder / "generation_config.json").is_file()
    assert not list(folder.glob("*.safetensors"))
    assert gguf_source(folder) == link.absolute()
    assert is_prepared(folder)


def test_gguf_folder_tokenizer_round_trips(served: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    link, folder = served
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, source = read_config_and_tokenizer(link)
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert ids == source.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT
    assert tokenizer.eos_token == SMOLLM2.eos_token


def test_resolve_model_reuses_the_prepared_gguf_folder(
    served: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    link, folder = served

    def must_not_write(gguf_path: Path, out: Path) -> None:
        raise AssertionError("prepared again")

    monkeypatch.setenv(CACHE_ENV, str(folder.parent.parent))
    monkeypatch.setattr(gguf_module, "write_gguf_folder", must_not_write)
    assert resolve_model(str(link)) == folder


def test_gguf_folder_is_keyed_by_the_files_mtime(synthetic: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(synthetic.read_bytes())
    before = gguf_dir(copy)
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 1_000_000_000))
    assert gguf_dir(copy) != before


def test_gguf_file_names_the_file_weights_are_served_from(tmp_path: Path) -> None:
    assert gguf_file(DEFAULT_MODEL) == store.locate_gguf(SMOLLM2)
    assert gguf_file(str(tmp_path)) is None
    with pytest.raises(NotFoundError, match=r"missing\.gguf"):
        gguf_file(str(tmp_path / "missing.gguf"))
    with pytest.raises(NotFoundError, match=r"missing\.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"))
