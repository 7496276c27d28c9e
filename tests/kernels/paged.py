"""A paged batch for attention kernel tests: per-sequence contiguous K/V and queries, the
same K/V scattered over a shuffled block pool, and the step's AttentionMetadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from headrace.kernels import AttentionMetadata, reference
from headrace.kernels.attention import window_first_blocks
from headrace.kernels.kv_layout import cache_shape


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]: the new tokens' queries, flattened
    kv_cache: torch.Tensor  # [num_blocks, 2, block_size, Hkv, row], every step's K/V written
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    values: list[torch.Tensor]
    #: (context length after the step, new tokens) per sequence, decodes first.
    seqs: list[tuple[int, int]]

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def queries(self, i: int) -> torch.Tensor:  # [num_new, H, D] of sequence i
        start, end = self.metadata.query_start_loc_cpu[i : i + 2]
        return self.query[start:end]


def build_paged_batch(
    seqs: list[tuple[int, int]],
    num_decode_seqs: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    kv_cache_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
) -> PagedBatch:
    """The cached prefix of each sequence is written as earlier steps would have, then this
    step's new K/V through the batch's slot mapping (the reference writer). The cache is in
    kv_cache_dtype (default: dtype; int8: quantized rows, see `headrace.kernels.kv_layout`).

    With a sliding window, the table entries of blocks wholly before a sequence's window (as
    the scheduler frees them) name a poisoned block instead: NaN in a float cache, so a
    kernel that reads one, even masked, returns NaN."""
    num_blocks = sum(math.ceil(n / block_size) for n, _ in seqs) + 3
    cache_dtype = kv_cache_dtype or dtype
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype)
    cache = torch.zeros(shape, dtype=cache_dtype)
    free = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, keys, values = [], [], []
    for seq_len, _ in seqs:
        tables.append([free.pop() for _ in range(math.ceil(seq_len / block_size))])
        keys.append(torch.randn(seq_len, num_kv_heads, head_dim).to(dtype))
        values.append(torch.randn(seq_len, num_kv_heads, head_dim).to(dtype))

    def slots(table: list[int], positions: range) -> list[int]:
        return [table[p // block_size] * block_size + p % block_size for p in positions]

    for table, k, v, (seq_len, num_new) in zip(tables, keys, values, seqs, strict=True):
        cached = seq_len - num_new
        reference.write_kv_cache(
            k[:cached],
            v[:cached],
            cache,
            torch.tensor(slots(table, range(cached)), dtype=torch.long),
        )
    query_start_loc, slot_mapping = [0], []
    for table, (seq_len, num_new) in zip(tables, seqs, strict=True):
        query_start_loc.append(query_start_loc[-1] + num_new)
        slot_mapping += slots(table, range(seq_len - num_new, seq_len))
    if sliding_window is not None:
        poison = next(b for b in free if b != 0)  # (not the tables' padding)
        free.remove(poison)
        if cache.is_floating_point():
            cache[poison] = float("nan")
        for table, (seq_len, num_new) in zip(tables, seqs, strict=True):
            (first,) = window_first_blocks([seq_len], num_new, block_size, sliding_window)
            table[:first] = [poison] * first
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = [n for n, _ in seqs]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decode_seqs=num_decode_seqs,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        block_size=block_size,
    )
    new_k = torch.cat([k[n - m :] for k, (n, m) in zip(keys, seqs, strict=True)])
    new_v = torch.cat([v[n - m :] for v, (n, m) in zip(values, seqs, strict=True)])
    cache = cache.to(device)
    reference.write_kv_cache(new_k.to(device), new_v.to(device), cache, metadata.slot_mapping)
    query = torch.randn(query_start_loc[-1], num_heads, head_dim).to(dtype).to(device)
    return PagedBatch(query, cache, metadata, keys, values, seqs)


def contiguous_attention(q, k, v, num_queries, sliding_window=None, softcap=None, sinks=None):
    """Attention in float32 for one sequence: the last num_queries tokens attend causally to
    all of k/v ([L, Hkv, D], contiguous), or to the last sliding_window positions of it; with
    a softcap, each scaled score s is softcap * tanh(s / softcap); with sinks ([H]), each
    head's softmax denominator also has exp(sinks[h])."""
    q, k, v = q.float(), k.float(), v.float()
    seq_len = k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, None] - sliding_window
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
        return out.transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # [H, Q, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = scores.masked_fill(~mask, float("-inf")).exp()  # (scores are small here)
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.float().exp()[:, None, None]
    return (weights / denominator @ v).transpose(0, 1)
