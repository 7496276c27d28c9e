"""The attention interface the model calls: write new K/V into the paged cache, then attend.

One `AttentionMetadata` is built per engine step by the model runner and shared by every
layer. The batch is flattened (varlen): sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``. Decode sequences (one query token each) come
first, so a backend can run them as one batch and loop or tile only over prefill chunks.

Backends: ``reference`` (plain torch, any device) now; Triton twins join on CUDA later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from headrace.kernels import reference


@dataclass(slots=True)
class AttentionMetadata:
    #: [T] int64: cache slot (block_id * block_size + offset) for each new token's K/V.
    slot_mapping: torch.Tensor
    #: [B + 1] int32: where each sequence's query rows start in the flattened batch.
    query_start_loc: torch.Tensor
    #: [B] int32: each sequence's context length (cached + new tokens) after this step.
    seq_lens: torch.Tensor
    #: [B, max_num_blocks] int32: each sequence's KV block ids, padded with 0.
    block_tables: torch.Tensor
    #: The first num_decode_seqs sequences have exactly one query token.
    num_decode_seqs: int
    #: Host copies of query_start_loc / seq_lens, so backends need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    reference.write_kv_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each new token over its sequence's cached + new K/V."""
    return reference.paged_attention(
        query,
        kv_cache,
        metadata.query_start_loc_cpu,
        metadata.seq_lens_cpu,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.num_decode_seqs,
        scale,
    )
