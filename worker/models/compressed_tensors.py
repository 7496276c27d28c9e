"""Read a compressed-tensors checkpoint's weight-only int8 / int4 layers as quantized weights.

llm-compressor (vLLM's quantizer) publishes W8A16 and W4A16 checkpoints in the
compressed-tensors format: config.json's ``quantization_config`` has ``quant_method``
"compressed-tensors", and each quantized linear layer ``X`` is stored as

    X.weight_packed   int32 [N, K * bits / 32]: the integers q + 2^(bits-1), element i at
                      bits [i * bits, (i + 1) * bits) of the little-endian words of its row
    X.weight_scale    [N, K / group_size] (one column for a per-channel scale)
    X.weight_shape    [2]: N, K

("pack-quantized", symmetric) and read back as ``W = q * scale``. Those are
`headrace.kernels.quantized`'s layouts: 8 bits, W = q * scale; 4 bits, the unsigned nibble
``u = q + 8`` with W = u * scale + offset, offset = -8 * scale. So a layer is taken apart,
never turned into floats: the 4-bit values are re-packed in GGML's nibble order. For scales of
bf16 or fp16 precision (as llm-compressor writes them) every product above is exact in
float32, so `dequantize` equals the format's own dequantization.

What headrace serves: weight-only schemes (no activation quantization), symmetric int
weights of 4 or 8 bits, per channel or in groups of a power of two from 32, in the
pack-quantized format, every Linear but lm_head quantized. Anything else (asymmetric zero
points, other formats, fp8) is refused when the engine starts, naming what it found.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from headrace.kernels import quantized
from headrace.kernels.quantized import QuantizedWeight
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.layers.weights import CheckpointTensor, LoadedTensor

#: config.json's quantization_config.quant_method for this format, and the quantization a
#: checkpoint in it runs at (`ModelSpec.quantization`).
QUANT_METHOD = COMPRESSED = "compressed-tensors"
#: The tensors a quantized layer ``X`` is stored as (``X.`` + each).
_PARTS = ("weight_packed", "weight_scale", "weight_shape")
#: The storage format served.
_FORMAT = "pack-quantized"


@dataclass(frozen=True, slots=True)
class CompressedScheme:
    """A checkpoint's weight quantization, as headrace holds it."""

    #: 4 or 8.
    bits: int
    #: Elements per scale along K; None: one per output channel.
    group_size: int | None

    @property
    def layout(self) -> tuple[int, int | None]:
        """(bits, group size) of the quantized linear layers."""
        return (self.bits, self.group_size)


def read_scheme(folder: Path) -> CompressedScheme | None:
    """The folder's compressed-tensors weight scheme, None for another checkpoint. Raises
    `InvalidArgumentError` ("model") for a scheme headrace does not serve."""
    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        return None
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        _refuse(f"{len(groups)} config groups (one, for every Linear, is served)")
    group = groups[0]
    if group.get("input_activations") or group.get("output_activations"):
        _refuse("activation quantization (only weight-only W8A16 / W4A16 is served)")
    ignored = set(quant.get("ignore") or []) - {"lm_head"}
    if ignored:
        _refuse(f"layers left unquantized ({', '.join(sorted(ignored))}; only lm_head may be)")
    storage = quant.get("format") or group.get("format")
    if storage != _FORMAT:
        _refuse(f"format {storage!r} ({_FORMAT} is served)")
    return _scheme(group.get("weights") or {})


def _scheme(weights: dict[str, Any]) -> CompressedScheme:
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    if kind != "int" or bits not in (4, 8):
        _refuse(f"{kind} weights of {bits} bits (int 4 or 8 is served)")
    assert isinstance(bits, int)
    if not weights.get("symmetric", True):
        _refuse("asymmetric weights (zero points; symmetric is served)")
    strategy, size = weights.get("strategy"), weights.get("group_size")
    if strategy == "channel":
        return CompressedScheme(bits, None)
    if strategy != "group" or not isinstance(size, int) or size < 32 or size & (size - 1):
        served = "channel, or groups of a power of two from 32"
        _refuse(f"strategy {strategy!r} with group_size {size!r} ({served})")
    return CompressedScheme(bits, size)


def _refuse(what: str) -> NoReturn:
    raise InvalidArgumentError("model", f"this compressed-tensors checkpoint has {what}")


def compressed_tensors(
    tensors: Iterable[tuple[str, CheckpointTensor]], scheme: CompressedScheme
) -> Iterator[tuple[str, LoadedTensor]]:
    """The checkpoint's tensors with each quantized layer's parts (read as they arrive, in
    any order within a file) joined into one `QuantizedWeight` named ``X.weight``; every
    other tensor as it is."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor.read()
        if len(parts) == len(_PARTS):
            yield f"{module}.weight", _quantized_weight(pending.pop(module), scheme)
    if pending:
        module, parts = next(iter(pending.items()))
        raise InvalidArgumentError(
            "model", f"{module} has only {sorted(parts)} of a compressed-tensors weight"
        )


def _quantized_weight(parts: dict[str, torch.Tensor], scheme: CompressedScheme) -> QuantizedWeight:
    """One layer's parts in `headrace.kernels.quantized`'s layout."""
    scale = parts["weight_scale"].float()  # [N, groups]: bf16 / fp16 widen exactly
    rows, cols = (int(n) for n in parts["weight_shape"].tolist())
    unsigned = _unpack(parts["weight_packed"], scheme.bits, rows, cols)  # q + 2^(bits - 1)
    group_size = scheme.group_size or cols
    if tuple(scale.shape) != (rows, cols // group_size):
        shape, weight = tuple(scale.shape), f"a [{rows}, {cols}] weight"
        raise InvalidArgumentError(
            "model", f"weight_scale of shape {shape} for {weight} in groups of {group_size}"
        )
    if scheme.bits == 8:
        data = (unsigned.to(torch.int16) - 128).to(torch.int8)
        return QuantizedWeight(8, group_size, data, scale.contiguous(), None)
    offsets = -8.0 * scale  # exact
    data = quantized.pack_nibbles(unsigned)
    return QuantizedWeight(4, group_size, data, scale.contiguous(), offsets)


def _unpack(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] unsigned integers (uint8) from rows of little-endian int32 words, element
    i at bits [i * bits, (i + 1) * bits) (4 bits: low nibble first; 8 bits: byte by byte)."""
    if sys.byteorder != "little":
        raise InvalidArgumentError("model", "compressed-tensors weights on a big-endian host")
    bytes_ = packed.contiguous().view(torch.uint8).view(rows, -1)
    if bits == 8:
        return bytes_[:, :cols].contiguous()
    nibbles = torch.stack((bytes_ & 15, bytes_ >> 4), dim=-1).view(rows, -1)
    return nibbles[:, :cols].contiguous()
