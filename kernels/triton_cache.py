"""Triton KV-cache write: each new token's K and V into its slot of the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [T, Hkv, D]: new keys; rows may be strided (views into the fused qkv output)
    value_ptr,  # [T, Hkv, D]: new values, same layout rules as key
    cache_ptr,  # [num_blocks, 2, block_size, Hkv, D]: the layer's paged cache
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
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    key = tl.load(
        key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :],
        mask=mask,
    )
    dst = (
        cache_ptr
        + block * cache_stride_block
        + offset * cache_stride_token
        + heads[:, None] * cache_stride_head
        + dims[None, :]
    )
    dtype = cache_ptr.dtype.element_ty
    tl.store(dst, key.to(dtype), mask=mask)
    tl.store(dst + cache_stride_plane, value.to(dtype), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != key.shape[1:]:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit keys {key.shape}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("key, value and kv_cache need a contiguous last (head_dim) axis")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {tuple(slot_mapping.shape)} != ({num_tokens},)")
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
    )
