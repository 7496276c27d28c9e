"""Triton LoRA shrink and expand (see `headrace.kernels.lora` for the algorithm and the
reference twins these equal).

One program per (row, block of output columns). Each program reads its row's slot and
multiplies the row by that slot's matrix, so rows of different adapters share one launch
and never a copy of the weights; a base row (slot -1) loads nothing and adds nothing.
Accumulation is float32; the result is rounded once, to the output's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headrace.kernels.lora import LoraIndices


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] rows with stride stride_x
    a_ptr,  # [S, R, K] contiguous
    slots_ptr,  # [T] int32
    out_ptr,  # [T, R] contiguous
    stride_x,
    K,
    R,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # A base row (slot -1) reads nothing: every column is masked off, so h stays zero.
    k_used = tl.where(slot >= 0, K, 0)
    a_base = a_ptr + tl.maximum(slot, 0) * R * K
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < k_used, other=0.0)
        a_mask = (ranks[:, None] < R) & (cols[None, :] < k_used)
        a = tl.load(a_base + ranks[:, None] * K + cols[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + row * R + ranks, acc.to(out_ptr.dtype.element_ty), mask=ranks < R)


@triton.jit
def _expand_kernel(
    h_ptr,  # [T, R] rows with stride stride_h
    b_ptr,  # [S, R, N] contiguous
    slots_ptr,  # [T] int32
    y_ptr,  # [T, *] rows with stride stride_y; columns offset .. offset + N updated
    stride_h,
    stride_y,
    offset,
    N,
    R,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # A base row (slot -1) neither reads nor writes: every column is masked off.
    n_used = tl.where(slot >= 0, N, 0)
    b_base = b_ptr + tl.maximum(slot, 0) * N * R
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + row * stride_h + ranks, mask=ranks < R, other=0.0)
        b_mask = (cols[:, None] < n_used) & (ranks[None, :] < R)
        b = tl.load(b_base + ranks[None, :] * N + cols[:, None], mask=b_mask, other=0.0)
        acc += tl.sum(b.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
    y_mask = cols < n_used
    y_cols = y_ptr + row * stride_y + offset + cols
    y = tl.load(y_cols, mask=y_mask, other=0.0)
    tl.store(y_cols, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    indices: LoraIndices,
) -> torch.Tensor:  # [T, R] in x's dtype; zero for base rows
    num_rows, in_features = x.shape
    _check(lora_a, 3, in_features, -1, "lora_a")
    if x.stride(1) != 1:
        x = x.contiguous()
    rank = lora_a.shape[1]
    out = torch.empty(num_rows, rank, dtype=x.dtype, device=x.device)
    if num_rows:
        block_r = max(16, triton.next_power_of_2(rank))
        grid = (num_rows, triton.cdiv(rank, block_r))
        _shrink_kernel[grid](
            x, lora_a.contiguous(), indices.slots, out, x.stride(0), in_features, rank,
            BLOCK_R=block_r, BLOCK_K=64,
        )  # fmt: skip
    return out


def lora_expand(
    h: torch.Tensor,  # [T, R]
    lora_b: torch.Tensor,  # [S, R, out]
    indices: LoraIndices,
    y: torch.Tensor,  # [T, Y]: updated in place
    offset: int,
) -> None:
    num_rows, rank = h.shape
    _check(lora_b, 3, rank, 1, "lora_b")
    out_features = lora_b.shape[2]
    if y.shape[0] != num_rows or offset + out_features > y.shape[1] or y.stride(1) != 1:
        raise ValueError(f"y {tuple(y.shape)} cannot take {out_features} columns at {offset}")
    if h.stride(1) != 1:
        h = h.contiguous()
    if num_rows:
        grid = (num_rows, triton.cdiv(out_features, 64))
        _expand_kernel[grid](
            h, lora_b.contiguous(), indices.slots, y, h.stride(0), y.stride(0), offset,
            out_features, rank, BLOCK_N=64, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        )  # fmt: skip


def _check(tensor: torch.Tensor, dims: int, size: int, dim: int, name: str) -> None:
    if tensor.dim() != dims or tensor.shape[dim] != size:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {size} in dim {dim}")
