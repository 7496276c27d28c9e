"""Plain-torch reference twins of the kernels: the oracle of the Triton and C kernels, and the
kernel set of a device neither serves (or of a CPU that cannot build the C kernels).

This module is a `KernelSet` (see `headrace.kernels.backend`): the Triton backend
(`headrace.kernels.triton_ops`) and the CPU backend (`headrace.kernels.cpu_ops`) have the
same functions with the same signatures, and take this module's where they have no kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from headrace.kernels.argmax import argmax_update
from headrace.kernels.attention import AttentionMetadata, window_first_blocks
from headrace.kernels.kv_layout import cache_rows, dequantize_rows, head_dim_of, is_quantized
from headrace.kernels.lora import lora_expand, lora_shrink
from headrace.kernels.precision import compute_dtype, linear
from headrace.kernels.quantized import linear as quantized_linear
from headrace.kernels.sampling import apply_token_bitmask, draw_tokens

NAME = "reference"

#: The batched LoRA references live with `LoraIndices` in `headrace.kernels.lora`, the
#: sampler's (the draw, the grammar bitmask) in `headrace.kernels.sampling` and the greedy
#: head's running argmax in `headrace.kernels.argmax`, the quantized matmul's (over the
#: dequantized weight) in `headrace.kernels.quantized`.
__all__ = [
    "NAME",
    "apply_rotary",
    "apply_token_bitmask",
    "argmax_update",
    "draw_tokens",
    "extend",
    "extend_fresh",
    "gather_kv",
    "linear",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "quantized_linear",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, row] (kv_layout)
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """K and V into their slots, converted to the cache's dtype (int8: quantized rows)."""
    block_size = kv_cache.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[block_ids, 0, offsets] = cache_rows(key, kv_cache.dtype)
    kv_cache[block_ids, 1, offsets] = cache_rows(value, kv_cache.dtype)


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, x + residual)
    """Add ``residual`` to ``x`` (when given), then RMS-normalise the sum.

    Returns the normalised tensor and the sum, the residual stream of the next block; without
    ``residual`` the sum is ``x`` itself. Rounding follows Hugging Face's LlamaRMSNorm: the
    add in the activation dtype, statistics in float32, cast back before the weight.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype), x


def apply_rotary(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim]: both halves equal (neox layout)
    sin: torch.Tensor,  # [T, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary (rotate halves), op for op as Hugging Face Llama applies it."""
    query = query * cos + _rotate_half(query) * sin
    key = key * cos + _rotate_half(key) * sin
    return query, key


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2 * intermediate]: the gate's columns, then up's
) -> torch.Tensor:  # [T, intermediate]
    """The gated MLP's activation: silu(gate) * up, each op rounded in the activation dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each new token over its sequence's cached + new K/V; with a
    sliding window, over the last ``sliding_window`` positions up to and including its own
    (see `headrace.kernels.attention` for the blocks before a window); with a soft cap, each
    score s becomes ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2); with sinks,
    each head's softmax has one more logit, ``sinks[h]``, in its denominator and no value
    (GPT-OSS's attention sinks)."""
    out = torch.empty_like(query)
    query_start_loc, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    num_decode_seqs = metadata.num_decode_seqs
    if num_decode_seqs:
        rows = query_start_loc[num_decode_seqs]
        out[:rows] = _decode(
            query[:rows], kv_cache, metadata, scale, sliding_window, softcap, sinks
        )
    for i in range(num_decode_seqs, len(seq_lens)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        table = metadata.block_tables[i : i + 1]
        out[start:end] = extend(
            query[start:end], kv_cache, table, seq_lens[i], scale, sliding_window, softcap, sinks
        )
    return out


def gather_kv(
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_num_blocks]
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [B, num_kv_heads, num_tokens, head_dim]
    """The first num_tokens cached tokens of each sequence as K and V views for SDPA (an
    int8 cache's rows dequantized to float32).

    K and V are gathered separately from their planes of the cache, so each gather yields a
    contiguous [B, nb, bs, Hkv, D] and the reshape / transpose after it copy nothing (the
    gather is this function's only copy; it dominates decode on CPU).
    """
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_tokens // block_size)
    index = block_tables[:, :num_blocks].long()
    batch = index.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], head_dim_of(kv_cache)
    planes = []
    for plane in (0, 1):
        gathered = kv_cache[:, plane][index]  # [B, nb, bs, Hkv, D], contiguous
        if is_quantized(kv_cache):
            gathered = dequantize_rows(gathered)
        flat = gathered.view(batch, num_blocks * block_size, num_kv_heads, head_dim)
        planes.append(flat[:, :num_tokens].transpose(1, 2))  # [B, Hkv, L, D] view
    return planes[0], planes[1]


def _decode(
    query: torch.Tensor,  # [B, H, D]: one token per sequence, the batch's first B
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """All decode sequences at once: gather K/V padded to the longest, mask the padding.

    With a window, each row's gather starts at the block holding its window's first key, so
    blocks before it are never read; the padding past a row's keys is zeroed as well as
    masked (it may be any block: 0 * inf is no zero)."""
    num_seqs = query.shape[0]
    block_tables, seq_lens = metadata.block_tables[:num_seqs], metadata.seq_lens[:num_seqs]
    first_blocks = window_first_blocks(
        metadata.seq_lens_cpu[:num_seqs], 1, metadata.block_size, sliding_window
    )
    num_tokens = max(
        n - b * metadata.block_size
        for n, b in zip(metadata.seq_lens_cpu[:num_seqs], first_blocks, strict=True)
    )
    first = torch.tensor(first_blocks, dtype=torch.long, device=query.device)
    if any(first_blocks):
        num_blocks = -(-num_tokens // metadata.block_size)
        index = first[:, None] + torch.arange(num_blocks, device=query.device)[None, :]
        block_tables = block_tables.gather(1, index.clamp(max=block_tables.shape[1] - 1))
    key, value = _widen(*gather_kv(kv_cache, block_tables, num_tokens))  # [B, Hkv, L, D]
    positions = first[:, None] * metadata.block_size + torch.arange(
        num_tokens, device=query.device
    )  # [B, L]
    visible = positions < seq_lens[:, None]
    if sliding_window is not None:
        visible &= positions > seq_lens[:, None] - 1 - sliding_window
        hidden = ~visible[:, None, :, None]  # [B, 1, L, 1]
        key, value = key.masked_fill(hidden, 0), value.masked_fill(hidden, 0)
    q = query.unsqueeze(2).to(key.dtype)  # [B, H, 1, D]
    out = _attend(q, key, value, visible[:, None, None, :], scale, softcap, sinks)
    return out.squeeze(2).to(query.dtype)


def extend(
    query: torch.Tensor,  # [Q, H, D]: the newest Q tokens of one sequence
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [1, max_num_blocks]
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One prefill chunk: new tokens attend to the cached prefix and causally to themselves
    (within the window, where there is one: the gather starts at its first query's window)."""
    num_queries = query.shape[0]
    if num_queries == seq_len and sliding_window is None and softcap is None and sinks is None:
        return extend_fresh(query.unsqueeze(0), kv_cache, block_table, scale)[0]
    block_size = kv_cache.shape[2]
    (first_block,) = window_first_blocks([seq_len], num_queries, block_size, sliding_window)
    first_pos = first_block * block_size
    table = block_table[:, first_block:]
    key, value = _widen(*gather_kv(kv_cache, table, seq_len - first_pos))  # [1, Hkv, L, D]
    q = query.transpose(0, 1).unsqueeze(0).to(key.dtype)  # [1, H, Q, D]
    # Query j sits at position seq_len - Q + j and sees keys up to and including it (and, in
    # a window, the window - 1 before it).
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
    k_pos = torch.arange(first_pos, seq_len, device=query.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [Q, L]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    out = _attend(q, key, value, mask, scale, softcap, sinks)
    return out[0].transpose(0, 1).to(query.dtype)


def extend_fresh(
    query: torch.Tensor,  # [B, L, H, D]: every token of B sequences of L tokens each
    kv_cache: torch.Tensor,  # already holding their K/V
    block_tables: torch.Tensor,  # [B, max_num_blocks]
    scale: float,
) -> torch.Tensor:  # [B, L, H, D]
    """Whole prompts of one length in one causal SDPA call (no window, cap or sinks). Each
    (sequence, head) is its own problem in torch's kernels, so a sequence's output is the
    same alone or in a batch."""
    key, value = _widen(*gather_kv(kv_cache, block_tables, query.shape[1]))  # [B, Hkv, L, D]
    q = query.transpose(1, 2).to(key.dtype)  # [B, H, L, D]
    out = F.scaled_dot_product_attention(
        q, key, value, is_causal=True, scale=scale, enable_gqa=_is_gqa(q, key)
    )
    return out.transpose(1, 2).to(query.dtype)


def _attend(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,  # [B, Hkv, L, D]
    mask: torch.Tensor,  # bool, broadcast to [B, H, Q, L]: the keys each query sees
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H]
) -> torch.Tensor:  # [B, H, Q, D]
    """SDPA, or with a soft cap or sinks the same written out as transformers' eager
    attention computes it for Gemma 2 and GPT-OSS: scaled scores capped, masked, each head's
    sink logit beside them, softmax in float32, the sink's probability dropped."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=_is_gqa(query, key)
        )
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, H, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat((scores, sink), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value)


def _widen(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V in the dtype attention computes in (fp32 where reduced-precision math is emulated)."""
    dtype = compute_dtype(key.dtype, key.device)
    return key.to(dtype), value.to(dtype)


def _is_gqa(query: torch.Tensor, key: torch.Tensor) -> bool:
    return query.shape[1] != key.shape[1]
