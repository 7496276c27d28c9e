"""The paged KV cache's layout, float or int8, and the int8 rows' reference quantization.

Per layer the cache is one tensor ``[num_blocks, 2 (K, V), block_size, num_kv_heads, row]``.
In a float cache a row is the head's ``head_dim`` values. In an int8 cache a row is
``head_dim`` int8 values followed by that row's float32 scale (4 bytes, native byte order):
a scale per token and head, stored inline as llama.cpp's Q8_0 cache blocks store theirs, so
one tensor per layer still holds everything and block copies, prefix reuse and sleep treat a
quantized cache exactly as a float one.

Quantization is symmetric: ``scale = max|x| / 127`` and ``q = round_half_even(x / scale)``,
each a single float32 operation (0 everywhere when the row is all zeros); a value is read
back as ``q * scale``, rounded once to float32. Every kernel set writes and reads these bits
the same way, so the C and Triton writers equal `quantize_rows` bit for bit.
"""

from __future__ import annotations

import torch

#: The values of EngineConfig.kv_cache_dtype / ``--kv-cache-dtype``: "auto" stores K and V
#: in the model's dtype; "int8" as int8 rows with a float32 scale each.
KV_CACHE_DTYPES = ("auto", "int8")

#: Bytes of an int8 row's scale, after its head_dim values.
SCALE_BYTES = 4

#: Largest magnitude of a quantized value.
QMAX = 127.0


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether the cache holds int8 rows with inline scales."""
    return kv_cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of dtype per cached (token, head) row."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int, int, int, int]:
    """One layer's cache shape in dtype (int8: rows carry their scale)."""
    if dtype == torch.int8 and head_dim % SCALE_BYTES:
        raise ValueError(f"an int8 KV cache needs head_dim divisible by 4, got {head_dim}")
    return (num_blocks, 2, block_size, num_kv_heads, row_width(head_dim, dtype))


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head_dim a cache holds (its last axis, less an int8 row's scale)."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(kv_cache) else width


def quantize_rows(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D + 4] int8
    """Rows of x (any float dtype) as int8 values and their float32 scale."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # Divided by a tensor, not by the number: CUDA multiplies by a Python divisor's
    # reciprocal, which can differ from the division in the last bit (the kernels divide).
    scale = amax / torch.full_like(amax, QMAX)
    q = torch.where(scale > 0, torch.round(x / scale), torch.zeros_like(x))
    shape = (*x.shape[:-1], x.shape[-1] + SCALE_BYTES)
    rows = torch.empty(shape, dtype=torch.int8, device=x.device)
    rows[..., : x.shape[-1]] = q.to(torch.int8)
    rows[..., x.shape[-1] :] = scale.flatten().view(torch.int8).view(*x.shape[:-1], SCALE_BYTES)
    return rows


def cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of x [..., D] as a cache of dtype stores them (int8: quantized)."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:  # [..., D + 4] int8 -> [..., D] f32
    """The float32 values of int8 rows: each value times its row's scale."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :head_dim].float() * scale
