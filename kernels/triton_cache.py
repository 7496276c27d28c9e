"""Triton KV-cache write: each new token's K and V into its slot of the paged cache.

A float cache stores the rows converted to its dtype. An int8 cache (`headrace.kernels.kv_layout`)
stores each (token, head) row quantized: ``head_dim`` int8 values, then the row's float32 scale,
bit for bit as `kv_layout.quantize_rows` computes them. Kernels reach a scale through an int8
pointer cast to a float32 one (`scale_pointers`), so it needs 4-byte alignment
(`check_scale_alignment`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from headrace.kernels.kv_layout import QMAX, SCALE_BYTES, head_dim_of, is_quantized

_QMAX = tl.constexpr(QMAX)  # jitted code reads module globals only as constexprs
#: 1.5 * 2**23: adding it to a float32 |y| < 2**22 leaves no fraction bits, so the add
#: rounds y to an integer half to even (round-to-nearest-even, the default mode), and
#: subtracting it is exact. Adds alone contract into no FMA, and without fast-math flags no
#: compiler folds (y + M) - M back to y.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def scale_pointers(
    row_ptrs,  # [N] int8 pointers: the first value of each int8 cache row
    HEAD_DIM: tl.constexpr,
):
    """Where each row's float32 scale sits: right after its HEAD_DIM int8 values."""
    return (row_ptrs + HEAD_DIM).to(tl.pointer_type(tl.float32))


@triton.jit
def _quantize(x):  # [H, D] float32, padding 0 -> ([H, D] float32 integers, [H] float32 scale)
    """kv_layout.quantize_rows, op for op: IEEE divisions (plain ``/`` may be approximate on a
    GPU), then round half to even."""
    scale = tl.div_rn(tl.max(tl.abs(x), axis=1), _QMAX)  # [H]
    # An all-zero row (scale 0) is divided by 1 instead: its values stay 0, as the reference's
    # where gives, without 0 / 0.
    divisor = tl.where(scale > 0, scale, 1.0)
    y = tl.div_rn(x, divisor[:, None])  # |y| <= 127.5: the magic add is exact rounding
    return (y + _ROUND_MAGIC) - _ROUND_MAGIC, scale


@triton.jit
def _store_rows(
    row_ptrs,  # [BLOCK_H]: the first element of each head's row in the cache
    x,  # [BLOCK_H, BLOCK_D]: the rows in the input's dtype, 0 where masked
    head_mask,  # [BLOCK_H]: heads that exist
    dims,  # [BLOCK_D]
    HEAD_DIM: tl.constexpr,
    QUANTIZED_KV: tl.constexpr,
):
    """One token's K (or V) rows into the cache: converted, or int8 values and their scale."""
    if QUANTIZED_KV:
        x, scale = _quantize(x.to(tl.float32))
        tl.store(scale_pointers(row_ptrs, HEAD_DIM), scale, mask=head_mask)
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    # To int8 the rounded values convert exactly (they lie in [-127, 127]).
    tl.store(row_ptrs[:, None] + dims[None, :], x.to(row_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]: new keys; rows may be strided (views into the fused qkv output)
    value_ptr,  # [T, Hkv, D]: new values, same layout rules as key
    cache_ptr,  # [num_blocks, 2, block_size, Hkv, row]: the layer's paged cache (kv_layout)
    slot_mapping_ptr,  # [T] int64: block_id * block_size + offset of each token
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_block,
    cache_stride_plane,
    cache_stride_token,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED_KV: tl.constexpr,  # an int8 cache: rows are quantized values + scale
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :],
        mask=mask,
        other=0.0,
    )  # [H, D]
    value = tl.load(
        value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
        mask=mask,
        other=0.0,
    )  # [H, D]
    rows = cache_ptr + block * cache_stride_block + offset * cache_stride_token  # K plane
    rows += heads * cache_stride_head  # [H]
    _store_rows(rows, key, head_mask, dims, HEAD_DIM, QUANTIZED_KV)
    _store_rows(rows + cache_stride_plane, value, head_mask, dims, HEAD_DIM, QUANTIZED_KV)


def check_scale_alignment(kv_cache: torch.Tensor) -> None:
    """An int8 cache's scales are accessed as float32: each must start on a 4-byte boundary."""
    if not is_quantized(kv_cache):
        return
    offsets = (kv_cache.data_ptr(), head_dim_of(kv_cache), *kv_cache.stride()[:-1])
    if any(n % SCALE_BYTES for n in offsets):
        raise ValueError(
            f"int8 kv_cache rows misaligned: data_ptr {kv_cache.data_ptr()}, head_dim "
            f"{head_dim_of(kv_cache)} and strides {kv_cache.stride()} need multiples of 4"
        )


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]: float32, bf16 or fp16
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, row] (kv_layout)
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[1] != 2
        or kv_cache.shape[3] != num_kv_heads
        or head_dim_of(kv_cache) != head_dim
    ):
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit keys {key.shape}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache need a contiguous last (head_dim) axis")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
    check_scale_alignment(kv_cache)
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=kv_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANTIZED_KV=is_quantized(kv_cache),
    )
