"""Gemma 2 and Gemma 3 (text): the Llama family's attention and gated MLP in Gemma's
decoder layer.

What differs from Llama, each read once by `ModelConfig`: four norms per layer (after
attention and around the MLP, "sandwich" norms), every norm's weight an offset from 1,
embeddings scaled by sqrt(hidden_size), scores scaled by ``query_pre_attn_scalar ** -0.5``,
a tanh-approximated GELU in the MLP, sliding-window layers alternating with full ones.
Gemma 2 soft-caps attention scores and final logits; Gemma 3 norms each q and k head and
gives its sliding-window layers a rope of their own. The checkpoint names are Llama's plus
the two extra norms, so the loader is `LlamaForCausalLM`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from headrace.kernels import AttentionMetadata, KernelSet
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.mlp import GatedMLP
from headrace.worker.models.config import ModelConfig
from headrace.worker.models.llama import LlamaAttention, LlamaForCausalLM, norm_of
from torch import nn


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer, parallel, dtype, kernels)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            bias=config.mlp_bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
            activation=config.activation,
        )
        hidden = config.hidden_size
        self.input_layernorm = norm_of(config, hidden, dtype, kernels)
        self.post_attention_layernorm = norm_of(config, hidden, dtype, kernels)
        self.pre_feedforward_layernorm = norm_of(config, hidden, dtype, kernels)
        self.post_feedforward_layernorm = norm_of(config, hidden, dtype, kernels)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous block's output
        residual: torch.Tensor | None,  # [T, hidden]: the stream it adds to; None at layer 0
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As in Llama, a norm that opens a block first adds the pending output to the
        # residual stream (fused); the norms that close a block normalise its output alone.
        normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(normed, rotary, kv_cache, metadata)
        hidden = self.post_attention_layernorm.normalize(attended)
        normed, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm.normalize(self.mlp(normed)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = GemmaDecoderLayer
