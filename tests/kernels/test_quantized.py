"""Quantized weights: `quantize` / `dequantize` (the torch reference) and the CPU backend's C
kernels over them.

The reference: int8 and int4 round each weight to within half a scale of its group, zero
groups stay exactly zero, 4-bit nibbles are packed in GGML's block order, and a slice of rows
or of whole groups of columns is the same slice of the dequantized weight.

The C kernels: `quantized_linear` forms each weight in registers exactly as `dequantize` does
and sums as the float32 kernel does, so up to `cpu_ops.SKINNY_MAX_ROWS` rows (where
`cpu_ops.linear` runs the float32 C kernel) its output is `cpu_ops.linear` over the
dequantized weight bit for bit (x float32 or bf16, strided rows, with or without bias), and a
row's output does not depend on the other rows. Past `cpu_ops.quantized_max_rows` rows the
weight is dequantized in C (`cpu_ops.dequantize`: the reference's values rounded once) for
torch's GEMM: the reference to float rounding (float32) or to bf16's.

Int8 activations (4-bit weights): the reference is x rounded per block of 32 times the
dequantized weight (checked against float64 arithmetic written out in the test); the C
kernel equals it to float32 rounding at every row count, and a row's output is the same
bits in any batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from headrace.kernels import cpu_decode, cpu_ops, quantized
from headrace.kernels.quantized import QuantizedWeight

from tests.kernels import needs_c_compiler

#: (bits, group size; None: one group per row, K): per channel, then groups; every K but
#: 192 off the multiples of 64, so the kernels' steps of 64 end inside a row.
LAYOUTS = [(8, None, 96), (8, 32, 160), (4, 32, 96), (4, 32, 160), (4, 64, 192)]
LAYOUT_IDS = [f"int{bits}-g{group or 'row'}-k{k}" for bits, group, k in LAYOUTS]
NUM_OUT = 37  # not a multiple of the kernel's 4-row weight tile
#: Rows of the C kernel's one-row weight streams (1, 2), around its 6-row tile, its last.
SKINNY_ROWS = [1, 2, 5, 6, 13, cpu_ops.SKINNY_MAX_ROWS]
#: Rows past the float32 C kernel's limit on AVX2 (still the quantized C kernel with AVX-512's
#: tiles: 64, 100), then past the quantized kernel's limit for the weight's bits (+1, +20),
#: where the weight is dequantized for torch's GEMM.
MORE_ROWS = ["64", "100", "limit+1", "limit+20"]


def rows_of(case: str, bits: int) -> int:
    limit = cpu_ops.quantized_max_rows(bits)
    return limit + int(case.removeprefix("limit+")) if case.startswith("limit") else int(case)


@pytest.fixture
def every_few_rows_in_kernel(monkeypatch):
    """Every row count of SKINNY_ROWS in the quantized C kernel (with AVX2's 8-lane tiles it
    hands int4 weights to the GEMM from 17 rows)."""
    for limits in (cpu_ops.QUANTIZED_MAX_ROWS, cpu_ops.QUANTIZED_MAX_ROWS_NARROW):
        for bits, limit in limits.items():
            monkeypatch.setitem(limits, bits, max(limit, cpu_ops.SKINNY_MAX_ROWS))


def make_weight(num_out: int, num_in: int, bits: int, group_size: int | None) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(bits * 1000 + (group_size or 0) + num_in)
    w = torch.randn(num_out, num_in, generator=generator) / num_in**0.5
    return quantized.quantize(w, bits, group_size or num_in)


def make_x(num_rows: int, num_in: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, num_in] with a row stride of num_in + 3 (a slice of a fused projection)."""
    generator = torch.Generator().manual_seed(num_rows + num_in)
    wide = torch.randn(num_rows, num_in + 3, generator=generator).to(dtype)
    return wide[:, 2 : 2 + num_in]


def group_view(t: torch.Tensor, group_size: int) -> torch.Tensor:  # [N, K] -> [N, K / g, g]
    return t.reshape(t.shape[0], -1, group_size)


# --- quantize / dequantize (the reference) -------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_rounds_each_weight_to_within_half_a_scale(group_size: int | None) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))
    g = group_size or w.shape[1]
    weight = quantized.quantize(w, 8, g)
    assert weight.data.dtype == torch.int8 and weight.offsets is None
    assert weight.scales.shape == (16, 128 // g)
    # The largest magnitude of each group is ±127 exactly: the whole range is used.
    q = group_view(weight.data.to(torch.int32), g)
    assert torch.equal(q.abs().amax(dim=2), torch.full_like(weight.scales, 127, dtype=torch.int32))
    error = group_view((quantized.dequantize(weight) - w).abs(), g)
    bound = weight.scales.unsqueeze(2) / 2 + 1e-6 * w.abs().max()  # + float32 rounding
    assert (error <= bound).all()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_rounds_each_weight_to_within_half_a_scale(group_size: int) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    weight = quantized.quantize(w, 4, group_size)
    assert weight.data.dtype == torch.uint8 and weight.data.shape == (16, 64)
    assert weight.offsets is not None
    q = group_view(quantized.integers(weight), group_size)
    assert int(q.max()) == 15 and int(q.min()) == 0
    # The offset is the group's minimum, which dequantizes exactly (q = 0).
    assert torch.equal(weight.offsets, group_view(w, group_size).amin(dim=2))
    error = group_view((quantized.dequantize(weight) - w).abs(), group_size)
    bound = weight.scales.unsqueeze(2) / 2 + 1e-6 * w.abs().max()  # + float32 rounding
    assert (error <= bound).all()


@pytest.mark.parametrize(("bits", "group_size"), [(8, None), (8, 32), (4, 32)])
def test_a_zero_group_dequantizes_to_exact_zeros(bits: int, group_size: int | None) -> None:
    """Zero rows (a vocabulary's padding) have a zero scale: no division by it, no NaN."""
    w = torch.randn(4, 64)
    w[1] = 0.0
    weight = quantized.quantize(w, bits, group_size or 64)
    assert torch.equal(weight.scales[1], torch.zeros_like(weight.scales[1]))
    assert torch.equal(quantized.dequantize(weight)[1], torch.zeros(64))


def test_nibbles_pack_in_ggml_block_order_and_unpack_back() -> None:
    """Byte j of each 16-byte block holds element j (low nibble) and j + 16 (high nibble)."""
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = quantized.pack_nibbles(q)
    assert packed.shape == (3, 32)
    assert torch.equal(packed[:, :16], q[:, :16] | (q[:, 16:32] << 4))
    assert torch.equal(packed[:, 16:], q[:, 32:48] | (q[:, 48:] << 4))
    assert torch.equal(quantized.unpack_nibbles(packed), q)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    assert torch.equal(quantized.pack_nibbles(quantized.unpack_nibbles(every_byte)), every_byte)


@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS, ids=LAYOUT_IDS)
def test_narrowed_rows_and_columns_are_slices_of_the_dequantized_weight(
    bits: int, group_size: int | None, num_in: int
) -> None:
    """What tensor parallelism takes: output rows (column-parallel), whole groups of input
    columns (row-parallel)."""
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    full = quantized.dequantize(weight)
    assert torch.equal(quantized.dequantize(weight.narrow(0, 5, 20)), full[5:25])
    g = weight.group_size
    for start, length in [(0, g), (g, num_in - g), (0, num_in)]:
        if length:
            columns = weight.narrow(1, start, length)
            assert torch.equal(quantized.dequantize(columns), full[:, start : start + length])


@pytest.mark.parametrize(("bits", "group_size"), [(8, 32), (4, 32), (4, 64), (8, None)])
def test_columns_off_group_boundaries_are_refused(bits: int, group_size: int | None) -> None:
    weight = make_weight(8, 128, bits, group_size)
    g = weight.group_size
    for start, length in [(16, g), (0, g + 16), (g // 2, g // 2)]:
        with pytest.raises(ValueError, match="do not fall on groups"):
            weight.narrow(1, start, length)


# --- the C kernels ---------------------------------------------------------------------------


@needs_c_compiler
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", SKINNY_ROWS)
@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS, ids=LAYOUT_IDS)
def test_few_rows_are_the_float_kernel_over_the_dequantized_weight_bit_for_bit(
    bits: int,
    group_size: int | None,
    num_in: int,
    num_rows: int,
    x_dtype: torch.dtype,
    with_bias: bool,
    every_few_rows_in_kernel: None,
) -> None:
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    x = make_x(num_rows, num_in, x_dtype)
    bias = torch.randn(NUM_OUT) if with_bias else None
    got = cpu_ops.quantized_linear(x, weight, bias, out_dtype=torch.float32)
    want = cpu_ops.linear(x.float(), quantized.dequantize(weight), bias)
    assert torch.equal(got, want)
    default = cpu_ops.quantized_linear(x, weight, bias)  # in x's dtype: rounded once
    assert default.dtype == x_dtype and torch.equal(default, want.to(x_dtype))


def test_the_kernels_rows_follow_the_tiles(monkeypatch):
    """The C kernel keeps quantized rows to AVX-512's limits where its tiles have 16 lanes and
    to AVX2's where they have 8 (each measured against the GEMM); the one-call
    decode stack takes as many (int8 activations: the 8 bits' limit)."""
    for wide, limits in (
        (True, cpu_ops.QUANTIZED_MAX_ROWS),
        (False, cpu_ops.QUANTIZED_MAX_ROWS_NARROW),
    ):
        monkeypatch.setattr(cpu_ops, "wide_tiles", lambda wide=wide: wide)
        for bits in (8, 4):
            assert cpu_ops.quantized_max_rows(bits) == limits[bits]
            assert cpu_decode.max_rows((bits, 32, False), torch.float32) == limits[bits]
            assert cpu_decode.max_rows((bits, 32, True), torch.float32) == limits[8]


@needs_c_compiler
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", MORE_ROWS)
@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS, ids=LAYOUT_IDS)
def test_more_rows_equal_the_reference(
    bits: int, group_size: int | None, num_in: int, rows: str, x_dtype: torch.dtype
) -> None:
    """The C kernel to float rounding; past its limit torch's GEMM in x's compute dtype:
    float32 to float rounding, bf16 (where the CPU multiplies it natively) to bf16's."""
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    x = make_x(rows_of(rows, bits), num_in, x_dtype)
    bias = torch.randn(NUM_OUT)
    got = cpu_ops.quantized_linear(x, weight, bias, out_dtype=torch.float32)
    want = quantized.linear(x, weight, bias, out_dtype=torch.float32)
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_c_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS, ids=LAYOUT_IDS)
def test_dequantize_in_c_is_the_reference_rounded_once(
    bits: int, group_size: int | None, num_in: int, dtype: torch.dtype
) -> None:
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    got = cpu_ops.dequantize(weight, dtype)
    assert got.dtype == dtype and torch.equal(got, quantized.dequantize(weight).to(dtype))


@needs_c_compiler
@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS, ids=LAYOUT_IDS)
def test_a_row_alone_gets_the_bits_it_gets_among_seven(
    bits: int, group_size: int | None, num_in: int
) -> None:
    """A decode's output does not depend on which other sequences share its step."""
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    x = make_x(8, num_in, torch.float32)
    batched = cpu_ops.quantized_linear(x, weight)
    for row in (0, 3, 7):
        alone = cpu_ops.quantized_linear(x[row : row + 1], weight)
        assert torch.equal(alone[0], batched[row])


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_that_are_not_whole_blocks_of_32_are_refused(bits: int) -> None:
    """The kernels step 16 lanes at a time with no tail: a row of 40 (int8 per channel, whose
    group is the row) would be summed wrong and dequantized past its end, so it is refused."""
    with pytest.raises(ValueError, match="rows of 40 are not whole blocks of 32"):
        quantized.quantize(torch.randn(37, 40), bits, 40 if bits == 8 else 32)


# --- int8 activations --------------------------------------------------------------------------

#: (bits, group size, K) of weights for int8 activations: odd numbers of blocks (96: 3, 160:
#: 5), even ones (192: 6, SmolLM2's 576: 18), groups of 32 and 64, and one group a row (None:
#: int8 per channel; for 4 bits a row of 5 blocks, not a power of two).
A8_LAYOUTS = [
    (4, 32, 96),
    (4, 32, 160),
    (4, 64, 192),
    (4, 32, 576),
    (4, None, 160),
    (8, 32, 96),
    (8, 64, 192),
    (8, None, 160),
    (8, None, 576),
]


def with_int8_activations(weight: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(weight, int8_activations=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_are_the_activations_rounded_per_block(bits: int) -> None:
    """The reference's own definition, against float64 arithmetic written out here: x rounded
    to int8 per block of 32 (scale max|x| / 127), then the dequantized weight times it."""
    weight = make_weight(NUM_OUT, 96, bits, 32)
    x = make_x(5, 96, torch.float32).contiguous()
    x[1, 32:64] = 0  # a zero block: scale 0, values 0
    blocks = x.reshape(5, 3, 32).double()
    sx = blocks.abs().amax(dim=2, keepdim=True) / 127
    rounded = torch.where(sx > 0, torch.round(blocks / torch.where(sx > 0, sx, 1)) * sx, 0)
    want = rounded.reshape(5, 96) @ quantized.dequantize(weight).double().T
    got = quantized.linear(x, with_int8_activations(weight))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, quantized.linear(x, weight), atol=1e-4)  # x was rounded


@needs_c_compiler
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [1, 2, 5, 13, 64, 300])
@pytest.mark.parametrize(("bits", "group_size", "num_in"), A8_LAYOUTS, ids=str)
def test_int8_activations_in_c_equal_the_reference_to_float_rounding(
    bits: int, group_size: int | None, num_in: int, num_rows: int, x_dtype: torch.dtype
) -> None:
    """Every row count takes the kernel (no GEMM past a limit); the integer dot products are
    exact, so the outputs differ from the float64 reference by float32 rounding of the
    scales and sums: within 1e-6 of sum |x| |w|."""
    weight = with_int8_activations(make_weight(NUM_OUT, num_in, bits, group_size))
    x = make_x(num_rows, num_in, x_dtype)
    bias = torch.randn(NUM_OUT)
    got = cpu_ops.quantized_linear(x, weight, bias, out_dtype=torch.float32)
    want = quantized.linear(x, weight, bias, out_dtype=torch.float32)
    magnitude = x.float().abs() @ quantized.dequantize(weight).abs().T + bias.abs()
    assert float(((got - want).abs() / magnitude).max()) < 1e-6


@needs_c_compiler
@pytest.mark.parametrize("num_out", [NUM_OUT, 64])  # single rows: 16 weight rows at a time
@pytest.mark.parametrize(("bits", "group_size", "num_in"), A8_LAYOUTS, ids=str)
def test_int8_activations_give_a_row_the_bits_it_gets_in_any_batch(
    bits: int, group_size: int | None, num_in: int, num_out: int
) -> None:
    weight = with_int8_activations(make_weight(num_out, num_in, bits, group_size))
    x = make_x(40, num_in, torch.float32)
    bias = torch.randn(num_out)
    batched = cpu_ops.quantized_linear(x, weight, bias)
    for rows in (slice(7, 8), slice(3, 5), slice(0, 13), slice(39, 40)):
        assert torch.equal(cpu_ops.quantized_linear(x[rows], weight, bias), batched[rows])


def test_columns_quantized_at_the_whole_rows_scale_are_the_whole_weights_columns() -> None:
    """What a row-parallel rank holds of a per-channel int8 weight: its columns of the weight
    one rank would hold, bit for bit."""
    w = torch.randn(NUM_OUT, 128)
    whole = quantized.dequantize(quantized.quantize(w, 8, 128))
    for start in (0, 64):
        half = quantized.quantize_columns(w, start, 64)
        assert half.group_size == 64
        assert torch.equal(quantized.dequantize(half), whole[:, start : start + 64])
