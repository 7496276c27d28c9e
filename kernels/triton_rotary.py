"""Triton rotary embedding (neox style: rotate halves) of queries and keys in one launch.

One program per token rotates all its query and key heads. Products and sums are rounded
to the activation dtype where the reference's separate torch ops round them, so bf16
results agree with Hugging Face's to the bit up to fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(
    src_ptr,  # [T, heads, D]: rows strided, head_dim contiguous
    dst_ptr,  # [T, heads, D] contiguous
    token,
    src_stride_t,
    src_stride_h,
    cos_lo,  # [BLOCK_HALF]: cos for the first half of the head dims
    cos_hi,  # [BLOCK_HALF]: cos for the second half
    sin_lo,
    sin_hi,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < half)
    src = src_ptr + token * src_stride_t + heads * src_stride_h + dims
    x_lo = tl.load(src, mask=mask, other=0.0)
    x_hi = tl.load(src + half, mask=mask, other=0.0)
    dtype = dst_ptr.dtype.element_ty
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x_hi, x_lo); each op rounded.
    lo = (x_lo * cos_lo[None, :]).to(dtype).to(tl.float32) - (x_hi * sin_lo[None, :]).to(dtype).to(
        tl.float32
    )
    hi = (x_hi * cos_hi[None, :]).to(dtype).to(tl.float32) + (x_lo * sin_hi[None, :]).to(dtype).to(
        tl.float32
    )
    dst = dst_ptr + token * NUM_HEADS * HEAD_DIM + heads * HEAD_DIM + dims
    tl.store(dst, lo.to(dtype), mask=mask)
    tl.store(dst + half, hi.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,  # [T, H, D]
    key_ptr,  # [T, Hkv, D]
    cos_ptr,  # [T, D] (a [T, 1, D] tensor): cos of each token's angles
    sin_ptr,  # [T, D]
    query_out_ptr,  # [T, H, D] contiguous
    key_out_ptr,  # [T, Hkv, D] contiguous
    query_stride_t,
    query_stride_h,
    key_stride_t,
    key_stride_h,
    cos_stride_t,
    sin_stride_t,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    half: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    mask = dims < half
    cos = cos_ptr + token * cos_stride_t + dims
    sin = sin_ptr + token * sin_stride_t + dims
    cos_lo = tl.load(cos, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos + half, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin + half, mask=mask, other=0.0).to(tl.float32)
    _rotate(
        query_ptr, query_out_ptr, token, query_stride_t, query_stride_h,
        cos_lo, cos_hi, sin_lo, sin_hi, NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _rotate(
        key_ptr, key_out_ptr, token, key_stride_t, key_stride_h,
        cos_lo, cos_hi, sin_lo, sin_hi, NUM_KV_HEADS, HEAD_DIM, BLOCK_KV_H, BLOCK_HALF,
    )  # fmt: skip


def apply_rotary(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim]
    sin: torch.Tensor,  # [T, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape != (num_tokens, num_kv_heads, head_dim):
        raise ValueError(f"key shape {tuple(key.shape)} does not fit query {query.shape}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary, got {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, 1, head_dim) or table.stride(-1) != 1:
            raise ValueError(f"{name} must be [{num_tokens}, 1, {head_dim}], got {table.shape}")
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("query and key need a contiguous last (head_dim) axis")
    dtype = torch.promote_types(query.dtype, cos.dtype)
    query_out = torch.empty(query.shape, dtype=dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=dtype, device=key.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query,
            key,
            cos,
            sin,
            query_out,
            key_out,
            query.stride(0),
            query.stride(1),
            key.stride(0),
            key.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return query_out, key_out
