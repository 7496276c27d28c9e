"""Quantized weights: the layout every kernel set multiplies, and its torch reference.

A linear layer's weight W [N, K] may be held as integers in groups of ``group_size`` along K
(each group a run of one output row), with a float32 scale per group and, for 4 bits, a
float32 offset per group:

    W[n, k] = scales[n, k // g] * q[n, k]                      (8 bits)
    W[n, k] = scales[n, k // g] * q[n, k] + offsets[n, k // g]  (4 bits)

each product and sum rounded to float32 in that order (never fused), so a kernel that forms
W in registers forms exactly the values `dequantize` gives, and its output equals a float
kernel's over those values.

- 8 bits: ``data`` is int8 [N, K], q in [-127, 127]. ``--quantization int8`` quantizes per
  output channel (one group per row, symmetric); GGUF's Q8_0 is groups of 32.
- 4 bits: ``data`` is uint8 [N, K / 2] in GGML's block order: each 32 elements of a row are
  16 bytes, byte j holding element j in its low nibble and element j + 16 in its high one,
  q in [0, 15]. A 16-lane kernel step then takes the low or the high nibbles of one 16-byte
  load. ``--quantization int4`` is groups of 32 with the group's minimum as offset (GGUF's
  Q4_1 exactly); Q4_0 is offsets = -8 * scales.

So every row is whole blocks of 32 (the kernels step 16 lanes at a time, with no tail), and
``group_size`` is a power of two from 32 (or K, for 8 bits per channel) that divides K. Slices
of output rows, and of K at group boundaries, are again quantized weights: tensor
parallelism splits them as it splits float weights.

A weight may also say ``int8_activations``: it is then multiplied by x quantized to int8
per block of 32 (llama.cpp's Q8_0 / Q8_1 schemes, DashInfer's A8W8, which let a CPU use int8
dot products), `linear_int8_activations`:

    sx[b] = max |x_b| / 127,  xq = round_half_even(x_b / sx[b])      (as the int8 KV cache)
    y[n]  = sum_b scales[n, g(b)] * sx[b] * (q[n, b] . xq[b])  +  sum_b offsets[n, g(b)] * S[b]
    S[b]  = sx[b] * sum(xq[b])                                       (4 bits; 8 have no offsets)

The integer dot products are exact; the rest is float, so kernels agree with this reference
to float rounding, not bit for bit, and with the float oracle only to the activations'
quantization error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

#: Elements per nibble block of a 4-bit row (16 bytes).
NIBBLE_BLOCK = 32
#: The largest 8-bit magnitude used (symmetric: -127..127).
INT8_MAX = 127
INT4_LEVELS = 15
#: ``--quantization int4``'s group: 32 elements, as GGUF's Q4_0 / Q4_1 (the best accuracy
#: of the 32-128 range; every scale and offset costs 8 bytes per 32 weights).
INT4_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A weight [N, K] as integers, scales and offsets (module docstring)."""

    #: 8 or 4.
    bits: int
    #: Elements of a row per scale; divides K.
    group_size: int
    #: int8 [N, K] (8 bits) or uint8 [N, K / 2] in nibble blocks (4 bits).
    data: torch.Tensor
    #: float32 [N, K / group_size].
    scales: torch.Tensor
    #: float32 [N, K / group_size] (4 bits), or None (8 bits: symmetric).
    offsets: torch.Tensor | None
    #: Multiplied by x quantized to int8 per block (module docstring).
    int8_activations: bool = False

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 8 or 4 bits, not {self.bits}")
        check_row(cols, self.group_size)
        groups = (rows, cols // self.group_size)
        if tuple(self.scales.shape) != groups or self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32 {groups}, not {tuple(self.scales.shape)}")
        if (self.offsets is None) != (self.bits == 8):
            raise ValueError("4-bit weights have offsets and 8-bit weights have none")

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape [N, K]."""
        rows, width = self.data.shape
        return rows, width * (2 if self.bits == 4 else 1)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        """Bytes a matmul reads: the integers, the scales and the offsets."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, start: int, length: int) -> QuantizedWeight:
        """Output rows [start, start + length) (views)."""
        offsets = None if self.offsets is None else self.offsets.narrow(0, start, length)
        return replace(
            self,
            data=self.data.narrow(0, start, length),
            scales=self.scales.narrow(0, start, length),
            offsets=offsets,
        )

    def columns(self, start: int, length: int) -> QuantizedWeight:
        """Input columns [start, start + length) at group boundaries (copies)."""
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"columns [{start}, {start + length}) do not fall on groups of {g}")
        per_byte = 2 if self.bits == 4 else 1
        data = self.data.narrow(1, start // per_byte, length // per_byte)
        offsets = None if self.offsets is None else self.offsets.narrow(1, start // g, length // g)
        scales = self.scales.narrow(1, start // g, length // g)
        return replace(
            self,
            data=data.contiguous(),
            scales=scales.contiguous(),
            offsets=None if offsets is None else offsets.contiguous(),
        )

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Like `torch.Tensor.narrow` on the float weight: output rows (dim 0, views), or
        input columns at group boundaries (dim 1), so weight loaders shard it as a tensor."""
        return self.rows(start, length) if dim == 0 else self.columns(start, length)

    def copy_(self, source: QuantizedWeight | torch.Tensor) -> None:
        """Overwrite these values (rows of a layer's weight) with ``source``'s: a float tensor
        is quantized as it lands; a quantized one of another layout is dequantized first."""
        if isinstance(source, torch.Tensor):
            source = quantize(source, self.bits, self.group_size)
        elif (source.bits, source.group_size) != (self.bits, self.group_size):
            source = quantize(dequantize(source), self.bits, self.group_size)
        if source.shape != self.shape:
            raise ValueError(f"a weight {source.shape} cannot fill one of {self.shape}")
        self.data.copy_(source.data)
        self.scales.copy_(source.scales)
        if self.offsets is not None and source.offsets is not None:
            self.offsets.copy_(source.offsets)

    def gather(self, rows: torch.Tensor) -> QuantizedWeight:
        """The rows ``rows`` ([T] int64) names, in that order (copies: an embedding lookup)."""
        offsets = None if self.offsets is None else self.offsets[rows]
        return replace(self, data=self.data[rows], scales=self.scales[rows], offsets=offsets)

    def zero_(self) -> None:
        """Every weight 0 (the padding rows of a vocabulary split across ranks)."""
        self.data.zero_()
        self.scales.zero_()
        if self.offsets is not None:
            self.offsets.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """The integers, the scales and the offsets (where it has them)."""
        return [self.data, self.scales] + ([] if self.offsets is None else [self.offsets])

    def moved(self, place: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """This weight with each of its `tensors` replaced by ``place(tensor)``."""
        offsets = None if self.offsets is None else place(self.offsets)
        return replace(self, data=place(self.data), scales=place(self.scales), offsets=offsets)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self.moved(lambda tensor: tensor.to(device))


def check_row(cols: int, group_size: int) -> None:
    """Refuse rows of ``cols`` the layout cannot hold in groups of ``group_size``."""
    if cols % NIBBLE_BLOCK:
        raise ValueError(f"rows of {cols} are not whole blocks of {NIBBLE_BLOCK}")
    power_of_two = group_size & (group_size - 1) == 0 and group_size >= NIBBLE_BLOCK
    if cols % group_size or not (power_of_two or group_size == cols):
        raise ValueError(
            f"group size {group_size} must divide the row of {cols} and be a power of two "
            f"from {NIBBLE_BLOCK} (or the whole row)"
        )


def empty(
    shape: tuple[int, int],
    bits: int,
    group_size: int,
    device: torch.device | None = None,
    int8_activations: bool = False,
) -> QuantizedWeight:
    """An uninitialised quantized weight of the float shape [N, K]."""
    rows, cols = shape
    groups = (rows, cols // group_size)
    if bits == 8:
        data = torch.empty(rows, cols, dtype=torch.int8, device=device)
    else:
        data = torch.empty(rows, cols // 2, dtype=torch.uint8, device=device)
    offsets = torch.empty(groups, device=device) if bits == 4 else None
    scales = torch.empty(groups, dtype=torch.float32, device=device)
    return QuantizedWeight(bits, group_size, data, scales, offsets, int8_activations)


def quantize(
    weight: torch.Tensor,  # [N, K]
    bits: int,
    group_size: int,
) -> QuantizedWeight:
    """Round ``weight`` to ``bits`` in groups of ``group_size`` along K (round to nearest).

    8 bits: symmetric, scale = max |w| / 127 of the group. 4 bits: offset = the group's
    minimum, scale = (max - min) / 15."""
    rows, cols = weight.shape
    check_row(cols, group_size)
    w = weight.detach().to(torch.float32).reshape(rows, cols // group_size, group_size)
    if bits == 8:
        scales = w.abs().amax(dim=2) / INT8_MAX
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
        q = torch.round(w / safe).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QuantizedWeight(8, group_size, q.reshape(rows, cols), scales.contiguous(), None)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = (high - low) / INT4_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(2)
    q = torch.round((w - low.unsqueeze(2)) / safe).clamp_(0, INT4_LEVELS).to(torch.uint8)
    return QuantizedWeight(4, group_size, pack_nibbles(q.reshape(rows, cols)), scales, low)


def quantize_columns(weight: torch.Tensor, start: int, length: int) -> QuantizedWeight:
    """Columns [start, start + length) of ``weight`` [N, K] at 8 bits, each row scaled as the
    whole row is (one group of ``length``): a per-channel int8 weight split along K across
    ranks keeps the scales one rank would have."""
    whole = quantize(weight, 8, weight.shape[1])
    columns = whole.data[:, start : start + length].contiguous()
    return QuantizedWeight(8, length, columns, whole.scales, None)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values in [0, 15] [N, K] -> [N, K / 2] in nibble blocks (module docstring)."""
    rows, cols = q.shape
    blocks = q.reshape(rows, cols // NIBBLE_BLOCK, 2, NIBBLE_BLOCK // 2)
    packed = blocks[:, :, 0] | (blocks[:, :, 1] << 4)
    return packed.reshape(rows, cols // 2)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] nibble blocks -> uint8 [N, K] in [0, 15]."""
    rows, width = data.shape
    blocks = data.reshape(rows, width // (NIBBLE_BLOCK // 2), 1, NIBBLE_BLOCK // 2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=2)
    return both.reshape(rows, width * 2)


def integers(weight: QuantizedWeight) -> torch.Tensor:
    """The q values [N, K] (int8, or uint8 for 4 bits)."""
    return weight.data if weight.bits == 8 else unpack_nibbles(weight.data)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [N, K] the integers stand for (module docstring's formula)."""
    rows, cols = weight.shape
    g = weight.group_size
    q = integers(weight).to(torch.float32).reshape(rows, cols // g, g)
    w = q * weight.scales.unsqueeze(2)
    if weight.offsets is not None:
        w = w + weight.offsets.unsqueeze(2)
    return w.reshape(rows, cols)


def linear(
    x: torch.Tensor,  # [T, K]
    weight: QuantizedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, N] in out_dtype (default: x's dtype)
    """The reference: x (as float32) against the dequantized weight, in float32 (with
    ``int8_activations``, `linear_int8_activations`)."""
    bias32 = None if bias is None else bias.to(torch.float32)
    if weight.int8_activations:
        y = linear_int8_activations(x, weight)
        return (y if bias32 is None else y + bias32).to(out_dtype or x.dtype)
    y = torch.nn.functional.linear(x.to(torch.float32), dequantize(weight), bias32)
    return y.to(out_dtype or x.dtype)


def quantize_activations(
    x: torch.Tensor,  # [T, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # (xq [T, K / 32, 32] int8, sx [T, K / 32] float32)
    """x per block of 32 as int8 and a float32 scale: sx = max|x| / 127, xq =
    round_half_even(x / sx) (0 for a zero block), each one float32 operation."""
    rows, cols = x.shape
    blocks = x.to(torch.float32).reshape(rows, cols // NIBBLE_BLOCK, NIBBLE_BLOCK)
    sx = blocks.abs().amax(dim=2) / INT8_MAX
    safe = torch.where(sx > 0, sx, torch.ones_like(sx)).unsqueeze(2)
    return torch.round(blocks / safe).to(torch.int8), sx


def linear_int8_activations(
    x: torch.Tensor,  # [T, K]
    weight: QuantizedWeight,  # [N, K]
) -> torch.Tensor:  # [T, N] float32
    """x quantized per block of 32 against the weight's integers (module docstring), summed in
    float64 and rounded once: every kernel's result to float rounding."""
    rows, cols = weight.shape
    xq, sx = quantize_activations(x)  # [T, B, 32], [T, B]
    num_blocks, g = cols // NIBBLE_BLOCK, weight.group_size
    integers = weight.data if weight.bits == 8 else unpack_nibbles(weight.data)
    q = integers.to(torch.float64).reshape(rows, num_blocks, NIBBLE_BLOCK)
    dots = torch.einsum("nbk,tbk->tnb", q, xq.to(torch.float64))  # exact integers
    per_block = g // NIBBLE_BLOCK  # blocks of a group
    scales = weight.scales.to(torch.float64).repeat_interleave(per_block, dim=1)  # [N, B]
    y = (dots * scales[None] * sx.to(torch.float64)[:, None, :]).sum(dim=2)
    if weight.offsets is not None:
        mins = weight.offsets.to(torch.float64).repeat_interleave(per_block, dim=1)
        y = y + (sx.to(torch.float64) * xq.to(torch.float64).sum(dim=2)) @ mins.T  # S @ mins
    return y.to(torch.float32)
