"""The attention op of one layer over the paged KV cache: store the new K/V, then attend
(causally, or within the layer's sliding window; scores soft-capped where the family caps
them; with a sink logit per head where it has sinks).

Projections and rotary live in the model's attention block, and the kernels (Triton on
CUDA, C on a CPU, torch reference elsewhere) come as the engine's `KernelSet`; the layer's
only weights are GPT-OSS's sinks.
"""

from __future__ import annotations

import functools

import torch
from headrace.kernels import AttentionMetadata, KernelSet
from headrace.worker.layers.weights import LoadedTensor, ShardId, load_into, new_parameter
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
        sinks_from_head: int | None = None,
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
        #: [num_heads] float32: each of this rank's heads' sink logit (GPT-OSS: the
        #: checkpoint's ``self_attn.sinks`` rows from head ``sinks_from_head`` on), or None.
        self.sinks: nn.Parameter | None = None
        if sinks_from_head is not None:
            loader = functools.partial(_load_head_rows, first_head=sinks_from_head)
            self.sinks = new_parameter((num_heads,), torch.float32, loader)

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
            query, kv_cache, metadata, self.scale, self.sliding_window, self.softcap, self.sinks
        )


def _load_head_rows(
    param: nn.Parameter, loaded: LoadedTensor, shard_id: ShardId, first_head: int
) -> None:
    """This rank's rows of a per-head vector (the sinks), in float32."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for a per-head vector"
    load_into(param, loaded.narrow(0, first_head, param.shape[0]))
