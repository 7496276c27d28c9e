"""The Triton quantized linear equals `headrace.kernels.quantized.linear` (on CPU through
TRITON_INTERPRET=1, set by tests/conftest.py; on a GPU compiled): 8 bits per channel and in
groups of 32, 4 bits in groups of 32, 64 and 128, one row (the matrix-vector path) and tiles
of rows, K and N that are not multiples of the kernel's blocks, with and without bias.

Tolerances: float32 agrees to float rounding (1e-5; only the order of the float32 sums
differs). bf16 x is widened exactly, so both sides compute the same float32 sums; rounding
them to bf16 may differ by one bf16 ulp (2^-7 relative: the interpreter truncates where a
GPU rounds to nearest). Identity rows read the dequantized weight back bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import quantized, triton_ops, triton_quantized

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT32_TOL = 1e-5
BF16_ULP = 2**-7
#: (bits, group size, K): per channel (group = K), then groups; K off BLOCK_K's multiples
#: where a group allows it (a masked tail step).
LAYOUTS = [(8, 96, 96), (8, 32, 160), (4, 32, 96), (4, 64, 192), (4, 128, 256)]
NUM_OUT = 72  # not a multiple of BLOCK_N


def make_weight(num_out: int, num_in: int, bits: int, group_size: int):
    generator = torch.Generator().manual_seed(bits * 1000 + group_size + num_in)
    w = torch.randn(num_out, num_in, generator=generator) / num_in**0.5
    return quantized.quantize(w, bits, group_size).to(DEVICE)


def make_x(num_tokens: int, num_in: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(num_tokens + num_in)
    return torch.randn(num_tokens, num_in, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 64])
@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS)
def test_quantized_linear_equals_reference(bits, group_size, num_in, num_tokens, with_bias, dtype):
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    x = make_x(num_tokens, num_in, dtype)
    bias = torch.randn(NUM_OUT, device=DEVICE).to(dtype) if with_bias else None
    expected = quantized.linear(x, weight, bias, out_dtype=torch.float32)
    got = triton_ops.quantized_linear(x, weight, bias)
    assert got.shape == (num_tokens, NUM_OUT) and got.dtype == dtype
    rtol = FLOAT32_TOL if dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(got.float(), expected, atol=FLOAT32_TOL, rtol=rtol)
    # Asked for float32, bf16 x gives the reference's float32 sums unrounded.
    wide = triton_ops.quantized_linear(x, weight, bias, out_dtype=torch.float32)
    torch.testing.assert_close(wide, expected, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)


@pytest.mark.parametrize(("bits", "group_size", "num_in"), LAYOUTS)
def test_identity_rows_give_the_dequantized_weight_exactly(bits, group_size, num_in):
    """x = I makes y = Wᵀ: each output is one product by 1.0, so the in-register weights
    must equal `dequantize`'s bit for bit (scale * q rounded before + offset, no FMA)."""
    weight = make_weight(NUM_OUT, num_in, bits, group_size)
    eye = torch.eye(num_in, device=DEVICE)
    got = triton_ops.quantized_linear(eye, weight)
    assert torch.equal(got, quantized.dequantize(weight).t())


def test_strided_rows_and_no_rows():
    """x may be a column slice of a wider tensor (a fused projection's output); T = 0 gives
    an empty result without a launch."""
    weight = make_weight(NUM_OUT, 64, 4, 32)
    fused = make_x(5, 3 * 64, torch.float32)
    x = fused[:, 64:128]
    expected = quantized.linear(x, weight)
    got = triton_quantized.quantized_linear(x, weight)
    torch.testing.assert_close(got, expected, atol=FLOAT32_TOL, rtol=FLOAT32_TOL)
    empty = triton_quantized.quantized_linear(x[:0], weight)
    assert empty.shape == (0, NUM_OUT)


def scales_not_contiguous(weight: quantized.QuantizedWeight) -> quantized.QuantizedWeight:
    scales = weight.scales.t().contiguous().t()  # the same values, column-major
    return quantized.QuantizedWeight(8, weight.group_size, weight.data, scales, None)


def data_of_wrong_dtype(weight: quantized.QuantizedWeight) -> quantized.QuantizedWeight:
    data = weight.data.view(torch.uint8)
    return quantized.QuantizedWeight(8, weight.group_size, data, weight.scales, None)


#: name -> (the message's start, a builder of (x, weight, bias) from a good x [3, 64] and a
#: good 8-bit weight [72, 64] in groups of 32).
BAD_INPUTS = {
    "x-columns-not-K": ("x has shape", lambda x, w: (x[:, :32], w, None)),
    "x-not-2d": ("x has shape", lambda x, w: (x[None], w, None)),
    "x-integer": ("x must be", lambda x, w: (x.to(torch.int32), w, None)),
    "bias-wrong-length": (
        "bias has shape",
        lambda x, w: (x, w, torch.zeros(NUM_OUT + 1, device=DEVICE)),
    ),
    "scales-not-contiguous": ("the weight's", lambda x, w: (x, scales_not_contiguous(w), None)),
    "data-wrong-dtype": ("8-bit data", lambda x, w: (x, data_of_wrong_dtype(w), None)),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_value_error(case):
    message, build = BAD_INPUTS[case]
    x, weight, bias = build(make_x(3, 64, torch.float32), make_weight(NUM_OUT, 64, 8, 32))
    with pytest.raises(ValueError, match=message):
        triton_ops.quantized_linear(x, weight, bias)


def test_bad_out_dtype_raises_value_error():
    x, weight = make_x(3, 64, torch.float32), make_weight(NUM_OUT, 64, 8, 32)
    with pytest.raises(ValueError, match="out_dtype"):
        triton_ops.quantized_linear(x, weight, out_dtype=torch.int8)
