"""Triton linear over a quantized weight (`headrace.kernels.quantized`): y = x Wᵀ + b with
W formed in registers from its integers, scales and offsets, never as a float tensor.

One program per (tile of BLOCK_T rows of x, tile of BLOCK_N output columns) walks K in
steps of BLOCK_K: it loads the step's integers, dequantizes them exactly as `dequantize`
does (scale * q rounded, then + offset; the launch turns off fused multiply-adds so a GPU
rounds the same way) and multiplies x, widened to float32, by them in float32 ("ieee": no
TF32), so the result is the reference's up to the order of the float32 sums. One row of x
(decode, T = 1) is a matrix-vector product: a broadcast multiply and a row sum, not a
16-row tl.dot that would be mostly padding.

4 bits: a step's bytes are BLOCK_K / 2 consecutive bytes of a row. In GGML's nibble blocks
byte c of a row holds element ``(c // 16) * 32 + c % 16`` in its low nibble and that
element + 16 in its high one; so the step is two products, the low nibbles against those
columns of x and the high nibbles against the columns 16 further on. Both nibbles of a
byte lie in one group (groups are whole 32-element blocks), so they share a scale.

Block sizes are untuned (no GPU where this was written); a benchmark should pick them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headrace.kernels.quantized import QuantizedWeight

#: Output columns and K elements per program step. BLOCK_K is a multiple of 32, so a 4-bit
#: step is whole nibble blocks (and BLOCK_K / 2 >= 16, tl.dot's minimum).
BLOCK_N = 64
BLOCK_K = 64
#: The most rows of x per program (tl.dot takes 16 at least).
MAX_BLOCK_T = 64
#: The integer tensor each width holds.
DATA_DTYPES = {8: torch.int8, 4: torch.uint8}
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _accumulate(
    acc,  # [BLOCK_T, BLOCK_N] float32: the running x Wᵀ
    x_ptr,  # [T, K] rows with stride stride_x
    tokens,  # [BLOCK_T]: this tile's rows of x
    cols,  # [BLOCK_COLS]: the columns of x that w's columns multiply
    w,  # [BLOCK_N, BLOCK_COLS] float32: dequantized weights
    T,
    K,
    stride_x,
    BLOCK_T: tl.constexpr,
):
    mask = (tokens[:, None] < T) & (cols[None, :] < K)
    x = tl.load(x_ptr + tokens[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if BLOCK_T == 1:
        acc += tl.sum(w * x, axis=1)[None, :]
    else:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    return acc


@triton.jit
def _dequantize_int8(
    data_ptr,  # [N, K] int8, contiguous
    scales_ptr,  # [N, K / GROUP_SIZE] float32, contiguous
    rows,  # [BLOCK_N]: output rows of the weight
    cols,  # [BLOCK_K]: columns of the weight
    N,
    K,
    GROUP_SIZE: tl.constexpr,
):  # -> [BLOCK_N, BLOCK_K] float32: scale * q
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    q = tl.load(data_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0)
    groups = cols // GROUP_SIZE
    scale_ptrs = scales_ptr + rows[:, None] * (K // GROUP_SIZE) + groups[None, :]
    scale = tl.load(scale_ptrs, mask=mask, other=0.0)
    return scale * q.to(tl.float32)


@triton.jit
def _dequantize_nibbles(
    data_ptr,  # [N, K / 2] uint8 nibble blocks, contiguous
    scales_ptr,  # [N, K / GROUP_SIZE] float32, contiguous
    offsets_ptr,  # [N, K / GROUP_SIZE] float32, contiguous
    rows,  # [BLOCK_N]: output rows of the weight
    bytes_,  # [BLOCK_K / 2]: byte columns of the rows
    low,  # [BLOCK_K / 2]: the element each byte's low nibble holds
    N,
    K,
    GROUP_SIZE: tl.constexpr,
):  # -> ([BLOCK_N, BLOCK_K / 2] float32 for the low nibbles, the same for the high ones)
    mask = (rows[:, None] < N) & (low[None, :] < K)
    packed = tl.load(data_ptr + rows[:, None] * (K // 2) + bytes_[None, :], mask=mask, other=0)
    group_ptrs = rows[:, None] * (K // GROUP_SIZE) + (low // GROUP_SIZE)[None, :]
    scale = tl.load(scales_ptr + group_ptrs, mask=mask, other=0.0)
    offset = tl.load(offsets_ptr + group_ptrs, mask=mask, other=0.0)
    w_low = scale * (packed & 15).to(tl.float32) + offset
    w_high = scale * (packed >> 4).to(tl.float32) + offset
    return w_low, w_high


@triton.jit
def _quantized_linear_kernel(
    x_ptr,  # [T, K] rows with stride stride_x (float32, bf16 or fp16)
    data_ptr,  # [N, K] int8 (BITS 8) or [N, K / 2] uint8 nibble blocks (BITS 4), contiguous
    scales_ptr,  # [N, K / GROUP_SIZE] float32, contiguous
    offsets_ptr,  # [N, K / GROUP_SIZE] float32, contiguous (BITS 4; unused for 8)
    bias_ptr,  # [N] (HAS_BIAS; unused otherwise)
    out_ptr,  # [T, N] contiguous, in the output dtype
    T,
    N,
    K,
    stride_x,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = _dequantize_int8(data_ptr, scales_ptr, rows, cols, N, K, GROUP_SIZE)
            acc = _accumulate(acc, x_ptr, tokens, cols, w, T, K, stride_x, BLOCK_T)
    else:
        for k0 in range(0, K, BLOCK_K):
            bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            # Byte c of a row: block c // 16, lane c % 16 (module docstring).
            low = (bytes_ // 16) * 32 + bytes_ % 16
            w_low, w_high = _dequantize_nibbles(
                data_ptr, scales_ptr, offsets_ptr, rows, bytes_, low, N, K, GROUP_SIZE
            )
            acc = _accumulate(acc, x_ptr, tokens, low, w_low, T, K, stride_x, BLOCK_T)
            acc = _accumulate(acc, x_ptr, tokens, low + 16, w_high, T, K, stride_x, BLOCK_T)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (tokens[:, None] < T) & (rows[None, :] < N)
    out_ptrs = out_ptr + tokens[:, None] * N + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def quantized_linear(
    x: torch.Tensor,  # [T, K]
    weight: QuantizedWeight,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, N] in out_dtype (default: x's dtype)
    """`headrace.kernels.quantized.linear`, with W dequantized in registers (not built for
    ``int8_activations``: refused)."""
    if weight.int8_activations:
        raise ValueError("int8 activations run on the cpu and reference kernels, not triton")
    out_dtype = out_dtype or x.dtype
    _check_inputs(x, weight, bias, out_dtype)
    num_tokens = x.shape[0]
    num_out, num_in = weight.shape
    out = torch.empty(num_tokens, num_out, dtype=out_dtype, device=x.device)
    if num_tokens == 0 or num_out == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    block_t = _rows_per_program(num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_out, BLOCK_N))
    offsets = weight.scales if weight.offsets is None else weight.offsets  # unused for 8 bits
    _quantized_linear_kernel[grid](
        x, weight.data, weight.scales, offsets, out if bias is None else bias, out,
        num_tokens, num_out, num_in, x.stride(0),
        BITS=weight.bits, GROUP_SIZE=weight.group_size, HAS_BIAS=bias is not None,
        BLOCK_T=block_t, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        enable_fp_fusion=False,  # scale * q is rounded before + offset, as in `dequantize`
    )  # fmt: skip
    return out


def _rows_per_program(num_tokens: int) -> int:
    """One row is a matrix-vector product; more are tl.dot tiles of 16 to MAX_BLOCK_T rows."""
    if num_tokens == 1:
        return 1
    return min(MAX_BLOCK_T, max(16, triton.next_power_of_2(num_tokens)))


def _check_inputs(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> None:
    num_out, num_in = weight.shape
    if x.dim() != 2 or x.shape[1] != num_in:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [T, {num_in}] for {weight.shape}")
    for name, dtype in (("x", x.dtype), ("out_dtype", out_dtype)):
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"{name} must be one of {ACTIVATION_DTYPES}, not {dtype}")
    if weight.data.dtype != DATA_DTYPES[weight.bits]:
        raise ValueError(
            f"{weight.bits}-bit data must be {DATA_DTYPES[weight.bits]}, not {weight.data.dtype}"
        )
    parts = [weight.data, weight.scales] + ([] if weight.offsets is None else [weight.offsets])
    if not all(part.is_contiguous() for part in parts):
        raise ValueError("the weight's data, scales and offsets must be contiguous")
    if bias is not None and (bias.shape != (num_out,) or not bias.is_contiguous()):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected contiguous ({num_out},)")
    tensors = [x, *parts] + ([] if bias is None else [bias])
    if any(tensor.device != x.device for tensor in tensors):
        raise ValueError(f"x, the weight and the bias must all be on {x.device}")
