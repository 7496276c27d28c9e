"""Read a GGUF file's tensors as shipped, under Hugging Face Llama checkpoint names.

Three GGML block formats are already the layout of `headrace.kernels.quantized`, so their
bytes are taken apart, never turned into floats. Each row of K elements is K / 32 blocks:

    Q8_0  34 bytes: d (fp16), 32 int8 q             W = d * q
    Q4_0  18 bytes: d (fp16), 16 nibble bytes       W = d * q + (-8 * d)
    Q4_1  20 bytes: d (fp16), m (fp16), 16 nibbles  W = d * q + m

The fp16 fields widen to float32 exactly, -8 * d is exact in float32, and GGML's nibble order
(element j low, j + 16 high) is the one the kernels read, so `dequantize` of what this module
yields equals gguf-py's dequantization of the same bytes. F32 / F16 / BF16 tensors come as
stored; any other type is dequantized to float32 by gguf-py (logged once per file).

llama.cpp's converter interleaves the rows of each head of attn_q / attn_k for its rotary
layout (Llama GGUFs only; Qwen2's are written as in the checkpoint). Undoing it moves whole
rows, so a quantized weight is un-permuted by taking its data, scales and offsets rows in the
same order: the result is what transformers' `load_gguf_checkpoint` gives, quantized.

GGUF lists a tensor's dims innermost first (ne0 = K), the reverse of torch's [N, K].

`write_gguf_folder` writes the rest of a checkpoint folder (config, tokenizer) with a marker
naming the GGUF file in place of weights; `gguf_source` reads that marker back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize as gguf_dequantize
from headrace.kernels.quantized import NIBBLE_BLOCK, QuantizedWeight
from headrace.worker.models.store import read_config_and_tokenizer

logger = logging.getLogger(__name__)

#: Written by `write_gguf_folder`: {"gguf_file": absolute path of the weights' GGUF}.
GGUF_MARKER = "headrace-gguf.json"
#: GGUF architectures whose tensors map onto Hugging Face Llama names (llama.cpp writes
#: Mistral as "llama"; Qwen2 adds q/k/v biases).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
#: Architectures whose attn_q / attn_k rows llama.cpp permuted (module docstring).
_PERMUTED_ARCHITECTURES = ("llama",)

#: GGUF block name (after ``blk.{i}.``) -> Hugging Face module under ``model.layers.{i}``.
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MODEL_MODULES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
#: Tensors with no Hugging Face counterpart: Llama 3.1's rope_freqs repeats what the
#: config's rope_scaling says.
_SKIPPED_MODULES = frozenset({"rope_freqs"})
_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class _BlockFormat:
    """Where a GGML block of 32 elements keeps its fields (byte offsets into the block)."""

    bits: int
    #: Bytes per block.
    block_bytes: int
    #: Where the fp16 minimum m lies (Q4_1), or None: the offset is -8 * d (Q4_0) or none.
    min_at: int | None
    #: Where the integers start (d is always bytes 0-1).
    q_at: int


_BLOCK_FORMATS = {
    GGMLQuantizationType.Q8_0: _BlockFormat(bits=8, block_bytes=34, min_at=None, q_at=2),
    GGMLQuantizationType.Q4_0: _BlockFormat(bits=4, block_bytes=18, min_at=None, q_at=2),
    GGMLQuantizationType.Q4_1: _BlockFormat(bits=4, block_bytes=20, min_at=2, q_at=4),
}
#: Q4_0's integers are q - 8, stored as q in [0, 15].
_Q4_0_ZERO = 8

Weight: TypeAlias = torch.Tensor | QuantizedWeight


def iter_gguf_tensors(path: Path) -> Iterator[tuple[str, Weight]]:
    """(Hugging Face name, weight) for every tensor of the GGUF file at ``path``.

    Q8_0 / Q4_0 / Q4_1 come as `QuantizedWeight` (groups of 32), F32 / F16 / BF16 as tensors
    in their dtype, other types dequantized to float32. Names and the architecture are
    checked before anything is yielded (ValueError)."""
    reader = GGUFReader(path)
    architecture = _architecture(reader, path)
    names = {tensor.name: hf_name(tensor.name) for tensor in reader.tensors}
    _log_dequantized(reader, path)
    heads = _head_counts(reader, architecture)
    for tensor in reader.tensors:
        name = names[tensor.name]
        if name is None:
            continue
        weight = _read(tensor)
        num_heads = heads.get(tensor.name.split(".")[-2])
        yield name, weight if num_heads is None else _unpermute(weight, num_heads)


def projection_bits(path: Path) -> int | None:
    """The bits the file's projections (attention and MLP weights) are shipped in: 4 if any
    is Q4_0 / Q4_1, else 8 if any is Q8_0, else None (float or other types: dequantized).
    A projection of another type than the one chosen is logged: it will be converted."""
    reader = GGUFReader(path)
    types = {
        tensor.name: tensor.tensor_type
        for tensor in reader.tensors
        if (hf_name(tensor.name) or "").endswith("_proj.weight")
    }
    bits = {_BLOCK_FORMATS[t].bits for t in types.values() if t in _BLOCK_FORMATS}
    chosen = min(bits, default=None)
    others = sorted(
        {
            t.name
            for t in types.values()
            if t not in _BLOCK_FORMATS or _BLOCK_FORMATS[t].bits != chosen
        }
    )
    if chosen is not None and others:
        logger.info(
            "%s: projections of types %s are converted to the file's %d-bit blocks",
            path.name,
            ", ".join(others),
            chosen,
        )
    return chosen


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a
    tensor Hugging Face checkpoints do not have; ValueError for one this module does not know."""
    parts = gguf_name.split(".")
    module, suffix = ".".join(parts[:-1]), parts[-1]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_MODULES:
        return f"model.layers.{parts[1]}.{_LAYER_MODULES[parts[2]]}.{suffix}"
    if module in _MODEL_MODULES:
        return f"{_MODEL_MODULES[module]}.{suffix}"
    if module in _SKIPPED_MODULES:
        return None
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama name")


def _architecture(reader: GGUFReader, path: Path) -> str:
    architecture = _read_string(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {architecture!r} is not supported (only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return architecture


def _head_counts(reader: GGUFReader, architecture: str) -> dict[str, int]:
    """The head count each permuted GGUF block name was interleaved with (empty: none)."""
    if architecture not in _PERMUTED_ARCHITECTURES:
        return {}
    num_heads = _read_int(reader, f"{architecture}.attention.head_count")
    if num_heads is None:
        raise ValueError(f"the GGUF has no {architecture}.attention.head_count")
    num_kv_heads = _read_int(reader, f"{architecture}.attention.head_count_kv")
    return {"attn_q": num_heads, "attn_k": num_kv_heads or num_heads}


def _read_string(reader: GGUFReader, key: str) -> str | None:
    field = reader.get_field(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def _read_int(reader: GGUFReader, key: str) -> int | None:
    field = reader.get_field(key)
    return None if field is None else int(field.parts[field.data[0]][0])


def _log_dequantized(reader: GGUFReader, path: Path) -> None:
    kept = _BLOCK_FORMATS.keys() | _FLOAT_TYPES.keys()
    dequantized = sorted({t.tensor_type.name for t in reader.tensors} - {t.name for t in kept})
    if dequantized:
        logger.info(
            "%s: %s tensors dequantized to float32 (no quantized layout for them)",
            path.name,
            ", ".join(dequantized),
        )


def _read(tensor: ReaderTensor) -> Weight:
    """One tensor in torch's [N, K] order: quantized as shipped, floats as stored."""
    block_format = _BLOCK_FORMATS.get(tensor.tensor_type)
    if block_format is not None and len(tensor.shape) == 2:
        return _quantized(tensor, block_format)
    dtype = _FLOAT_TYPES.get(tensor.tensor_type)
    if dtype is not None:
        # np.array copies out of the read-only memory map. BF16 is read as bytes.
        return torch.from_numpy(np.array(tensor.data)).view(dtype)
    try:
        return torch.from_numpy(gguf_dequantize(tensor.data, tensor.tensor_type))
    except NotImplementedError as exc:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {exc}") from exc


def _quantized(tensor: ReaderTensor, block_format: _BlockFormat) -> QuantizedWeight:
    """The blocks of a Q8_0 / Q4_0 / Q4_1 tensor taken apart into integers, scales, offsets."""
    cols, rows = (int(n) for n in tensor.shape)  # ne0 = K first
    num_groups = cols // NIBBLE_BLOCK
    blocks = tensor.data.reshape(rows, num_groups, block_format.block_bytes)  # uint8, mmap
    scales = _fp16_field(blocks, 0)
    q = np.array(blocks[:, :, block_format.q_at :])
    if block_format.bits == 8:
        data = torch.from_numpy(q.view(np.int8).reshape(rows, cols))
        return QuantizedWeight(8, NIBBLE_BLOCK, data, scales, None)
    if block_format.min_at is None:
        offsets = scales * -_Q4_0_ZERO
    else:
        offsets = _fp16_field(blocks, block_format.min_at)
    data = torch.from_numpy(q.reshape(rows, cols // 2))
    return QuantizedWeight(4, NIBBLE_BLOCK, data, scales, offsets)


def _fp16_field(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of every block [N, G, bytes], widened to float32 [N, G]."""
    halves = np.array(blocks[:, :, at : at + 2]).view(np.float16)[:, :, 0]
    return torch.from_numpy(halves.astype(np.float32))


def _unpermute(weight: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's rotary interleave of q / k rows: within each head, GGUF row 2 d + t
    is Hugging Face row t * head_dim / 2 + d."""
    num_rows = weight.shape[0]
    if num_rows % (2 * num_heads):
        raise ValueError(f"{num_rows} rows do not split into {num_heads} heads of pairs")
    order = torch.arange(num_rows).reshape(num_heads, -1, 2).transpose(1, 2).reshape(num_rows)
    if isinstance(weight, torch.Tensor):
        return weight[order]
    offsets = None if weight.offsets is None else weight.offsets[order]
    return QuantizedWeight(
        weight.bits, weight.group_size, weight.data[order], weight.scales[order], offsets
    )


def write_gguf_folder(gguf_path: Path, out: Path) -> None:
    """A Hugging Face folder for the GGUF's model, without weights, into ``out``.

    config.json, generation_config.json and the tokenizer files, as transformers reads them
    from the GGUF, and `GGUF_MARKER` naming the GGUF file the weights are served from."""
    from transformers import GenerationConfig

    _architecture(GGUFReader(gguf_path), gguf_path)
    config, tokenizer = read_config_and_tokenizer(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {"gguf_file": str(gguf_path.absolute())}
    (out / GGUF_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a folder written by `write_gguf_folder` serves its weights from."""
    marker = folder / GGUF_MARKER
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["gguf_file"])
