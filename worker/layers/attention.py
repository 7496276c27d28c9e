"""The attention op of one layer over the paged KV cache: store the new K/V, then attend
(causally, or within the layer's sliding window).

This layer has no weights: projections and rotary live in the model's attention block, and
the kernels (Triton on CUDA, torch reference elsewhere) come as the engine's `KernelSet`.
"""

from __future__ import annotations

import torch
from headrace.kernels import AttentionMetadata, KernelSet
from torch import nn


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        kernels: KernelSet,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.kernels = kernels
        # Counts are per tensor-parallel rank.
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        #: The keys a token sees, its own included (None: all of its sequence's).
        self.sliding_window = sliding_window
        #: Scores soft-capped to (-softcap, softcap) before the softmax (Gemma 2), or None.
        self.softcap = softcap

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        self.kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return self.kernels.paged_attention(
            query, kv_cache, metadata, self.scale, self.sliding_window, self.softcap
        )
