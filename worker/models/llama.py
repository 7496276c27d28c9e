"""The Llama family forward pass: Llama (incl. Llama 3 rope scaling), Mistral, Qwen2, Qwen3,
and the mixtures of experts built on them: Mixtral, Qwen2-MoE, Qwen3-MoE.

One implementation; the families differ only in switches `ModelConfig` reads from the HF
config (a sparse layer's MLP is a `SparseMoe`, `layers/moe.py`). Module and parameter names
follow the HF checkpoint (``model.layers.N.self_attn``, ``mlp``, ``input_layernorm``, ...)
except where projections are fused, which `packed_modules_mapping` records for the loader.

The batch is flat: T tokens from any mix of prefill chunks and decodes, with the KV cache
and `AttentionMetadata` saying which sequence each token belongs to. On the CPU kernels a
step of decodes alone runs the decoder layers in one C call (`headrace.kernels.cpu_decode`)
where the stack has its plain shape, with the same values as the layer-by-layer forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from headrace.kernels import AttentionMetadata, KernelSet, cpu_decode
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.attention import Attention
from headrace.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from headrace.worker.layers.linear import QKVParallelLinear, RowParallelLinear, kv_heads_per_rank
from headrace.worker.layers.mlp import GatedMLP
from headrace.worker.layers.moe import SparseMoe
from headrace.worker.layers.norm import RMSNorm
from headrace.worker.layers.rotary import RotaryEmbedding
from headrace.worker.layers.weights import LoadedTensor, ShardId
from headrace.worker.models.config import ModelConfig
from headrace.worker.models.loader import load_weights
from torch import nn


def norm_of(config: ModelConfig, size: int, dtype: torch.dtype, kernels: KernelSet) -> RMSNorm:
    """An RMSNorm as the family defines it (Gemma's weights are offsets from 1)."""
    offset = 1.0 if config.is_gemma else 0.0
    return RMSNorm(size, config.rms_norm_eps, kernels, dtype=dtype, weight_offset=offset)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.qkv_bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = norm_of(config, head_dim, dtype, kernels)
            self.k_norm = norm_of(config, head_dim, dtype, kernels)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = head_dim
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            head_dim,
            config.attention_scale,
            kernels,
            config.window_of(layer),
            config.attn_softcap,
            sinks_from_head=parallel.tensor_parallel_rank * self.num_heads
            if config.attention_sinks
            else None,
        )
        self.kernels = kernels

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        q, k = self.kernels.apply_rotary(q, k, *rotary)
        out = self.attn(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.flatten(-2))


class LlamaDecoderLayer(nn.Module):
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
        self.mlp: GatedMLP | SparseMoe
        if config.moe is not None and config.moe.is_sparse(layer):
            self.mlp = SparseMoe(config.hidden_size, config.moe, parallel, dtype, kernels)
        else:
            self.mlp = GatedMLP(
                config.hidden_size,
                config.intermediate_size,
                bias=config.mlp_bias,
                parallel=parallel,
                dtype=dtype,
                kernels=kernels,
                activation=config.activation,
            )
        self.input_layernorm = norm_of(config, config.hidden_size, dtype, kernels)
        self.post_attention_layernorm = norm_of(config, config.hidden_size, dtype, kernels)
        #: The projections LoRA may adapt (a mixture's experts take none). A tuple, not a
        #: ModuleList: read each decode step, without nn.Module's lookup.
        self.projections: tuple[nn.Module, ...] = (self.self_attn.qkv_proj, self.self_attn.o_proj)
        if isinstance(self.mlp, GatedMLP):
            self.projections += (self.mlp.gate_up_proj, self.mlp.down_proj)

    def decode_weights(self) -> cpu_decode.DecoderLayerWeights:
        """This layer's parameters for `cpu_decode` (a dense layer's)."""
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, GatedMLP), "cpu_decode runs dense models only"
        return cpu_decode.DecoderLayerWeights(
            input_norm=self.input_layernorm.weight,
            qkv=attn.qkv_proj.matrix(),
            o_proj=attn.o_proj.matrix(),
            post_norm=self.post_attention_layernorm.weight,
            gate_up=mlp.gate_up_proj.matrix(),
            down=mlp.down_proj.matrix(),
            sliding_window=attn.attn.sliding_window,
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the previous block's output
        residual: torch.Tensor | None,  # [T, hidden]: the stream it adds to; None at layer 0
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm first adds the pending block output to the residual stream (fused).
        normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, rotary, kv_cache, metadata)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it.

    A stage builds only its own layers; the others stay as empty placeholders so parameter
    names keep the checkpoint's global layer numbers. The first stage embeds tokens; a later
    stage starts from the (hidden, residual) pair the previous stage handed over; the last
    stage applies the final norm.
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
        decoder_layer: type[nn.Module],
    ) -> None:
        super().__init__()
        self.layer_range = parallel.stage_layers(config.num_layers)
        self.embed_tokens: VocabParallelEmbedding | None = None
        if parallel.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel=parallel, dtype=dtype
            )
        self.layers = nn.ModuleList(
            decoder_layer(config, i, parallel, dtype, kernels)
            if i in self.layer_range
            else nn.Identity()
            for i in range(config.num_layers)
        )
        self.norm: RMSNorm | None = None
        if parallel.is_last_stage:
            self.norm = norm_of(config, config.hidden_size, dtype, kernels)
        #: Gemma scales the embeddings by sqrt(hidden_size), rounded to the model's dtype.
        self.embedding_scale = config.hidden_size**0.5 if config.is_gemma else None
        # One cos/sin table for all layers: it is [max_position, head_dim] per copy. Gemma 3's
        # sliding-window layers have their own (local_rope).
        self.rotary_emb = RotaryEmbedding(config.rope)
        self.local_rotary_emb = RotaryEmbedding(config.local_rope) if config.local_rope else None
        self.is_local = [config.window_of(i) is not None for i in range(config.num_layers)]
        self.decode_shape = _decode_shape(config, parallel, kernels)
        #: Built at the first decode step with `decode_shape` (None: layer by layer).
        self._decode_stack: cpu_decode.DecoderStack | None = None
        #: The stack's layers' `projections`, flat (set with the stack).
        self._adaptable: tuple[nn.Module, ...] = ()
        #: Called between two layers with the share run (`watch_layers`), or None.
        self._between_layers: Callable[[float], None] | None = None

    def watch_layers(self, between: Callable[[float], None]) -> None:
        """Call ``between(progress)`` between two of this stage's layers in every forward
        (progress: the share of them run), the one-call stack's long steps included."""
        self._between_layers = between

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per layer of this stage
        metadata: AttentionMetadata,
        carry: torch.Tensor | None = None,  # [2, T, hidden]: the previous stage's output
    ) -> torch.Tensor:  # last stage: [T, hidden] normed; earlier: [2, T, hidden]
        residual: torch.Tensor | None = None
        if carry is None:
            assert self.embed_tokens is not None, "a later stage needs the previous one's carry"
            hidden = self.embed_tokens(input_ids)
            if self.embedding_scale is not None:
                hidden = hidden * torch.tensor(self.embedding_scale, dtype=hidden.dtype)
        else:
            hidden, residual = carry[0], carry[1]
        rotary = self.rotary_emb(positions, hidden.dtype)
        local = self.local_rotary_emb
        local_rotary = rotary if local is None else local(positions, hidden.dtype)
        layers = self.stage_layers()
        if carry is None:
            decoded = self._decode_in_one_call(hidden, layers, rotary, kv_caches, metadata)
            if decoded is not None:
                return decoded
        between = self._between_layers
        for index, (i, layer, kv_cache) in enumerate(
            zip(self.layer_range, layers, kv_caches, strict=True)
        ):
            if index and between is not None:
                between(index / len(layers))
            cos_sin = local_rotary if self.is_local[i] else rotary
            hidden, residual = layer(hidden, residual, cos_sin, kv_cache, metadata)
        assert residual is not None, "every stage runs at least one layer"
        if self.norm is None:
            return torch.stack((hidden, residual))
        normed, _ = self.norm(hidden, residual)
        return normed

    def stage_layers(self) -> list[nn.Module]:
        """This stage's layers (the others are placeholders). A plain list: slicing the
        ModuleList builds a new one, module by module (0.17 ms, every step)."""
        return list(self.layers)[self.layer_range.start : self.layer_range.stop]

    def _decode_in_one_call(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embeddings
        layers: Iterable[nn.Module],
        rotary: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, hidden] normed, or None: run layer by layer
        if self.decode_shape is None or self.norm is None:
            return None
        if self._decode_stack is None:
            own = [layer for layer in layers if isinstance(layer, LlamaDecoderLayer)]
            weights = [layer.decode_weights() for layer in own]
            self._decode_stack = cpu_decode.DecoderStack(
                weights, self.norm.weight, self.decode_shape
            )
            self._adaptable = tuple(linear for layer in own for linear in layer.projections)
        stack = self._decode_stack
        if self._adapters_on() or not stack.fits(
            hidden.shape[0], hidden.dtype, kv_caches, metadata
        ):
            return None
        return stack.decode(hidden, *rotary, kv_caches, metadata, self._between_layers)

    def _adapters_on(self) -> bool:
        """Whether a LoRA adapter is on a projection: those run layer by layer (one flat pass
        over the projections a step)."""
        return any(linear.lora is not None for linear in self._adaptable)

    def decode_greedy_runs(
        self,
        input_ids: torch.Tensor,  # [T]: the first run's
        positions: torch.Tensor,  # [T]: the first run's
        later_slots: list[list[int]],  # [runs - 1][T]
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,  # the first run's
        head: torch.Tensor,  # [N, hidden]: the LM head's `greedy_weight`
    ) -> list[list[int]] | None:  # [runs][T], or None: run them from Python
        """A step of greedy one-row decodes in one call of the one-call stack
        (`cpu_decode.DecoderStack.greedy_runs`), where it serves the step: built by an
        earlier forward, no adapter on, embeddings looked up as they lie and no local
        rotary."""
        stack, embedding = self._decode_stack, self.embed_tokens
        plain = self.embedding_scale is None and self.local_rotary_emb is None
        if stack is None or embedding is None or not plain or self._adapters_on():
            return None
        table = embedding.lookup_table()
        if table is None:
            return None
        tables = cpu_decode.GreedyTables(table, head, *self.rotary_emb.tables(stack.dtype))
        return stack.greedy_runs(input_ids, positions, later_slots, kv_caches, metadata, tables)


def _decode_shape(
    config: ModelConfig, parallel: ParallelConfig, kernels: KernelSet
) -> cpu_decode.DecoderShape | None:
    """The stack's shape for `cpu_decode` where it serves this model: the CPU kernels, one
    rank and one stage, no biases, no q/k norm, no experts, no sinks, Llama's layers (not
    Gemma's). None otherwise."""
    whole = parallel.is_first_stage and parallel.is_last_stage
    if kernels.NAME != "cpu" or parallel.tensor_parallel_size > 1 or not whole:
        return None
    if config.qkv_bias or config.o_proj_bias or config.mlp_bias or config.qk_norm or config.moe:
        return None
    if config.is_gemma or config.attention_sinks:  # (the stack has no caps, sinks, ...)
        return None
    return cpu_decode.DecoderShape(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        eps=config.rms_norm_eps,
        scale=config.attention_scale,
    )


class LlamaForCausalLM(nn.Module):
    #: The decoder layer of the family (Gemma's subclass has its own).
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    #: Checkpoint module name -> (the fused module holding it, its shard id), for the loader.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        self.model = LlamaModel(config, parallel, dtype, kernels, self.decoder_layer)
        self.lm_head: ParallelLMHead | None = None
        if parallel.is_last_stage:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                parallel=parallel,
                dtype=dtype,
                kernels=kernels,
            )
        if config.tie_word_embeddings and self.lm_head and self.model.embed_tokens:
            self.lm_head.tie_to(self.model.embed_tokens)
        # The interface the model runner sizes the KV cache and the sampler by (per rank).
        self.num_layers = len(self.model.layer_range)
        self.num_kv_heads = kv_heads_per_rank(config.num_kv_heads, parallel)
        self.head_dim = config.head_dim
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.max_position_embeddings = config.max_position_embeddings
        self.kv_window = config.kv_window  # (the whole model's, as the scheduler needs)

    @classmethod
    def from_hf_config(
        cls, hf_config: Any, parallel: ParallelConfig, dtype: torch.dtype, kernels: KernelSet
    ) -> LlamaForCausalLM:
        """A model with uninitialised weights on the current default device."""
        return cls(ModelConfig.from_hf(hf_config), parallel, dtype, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer of this stage [num_blocks, 2, block, Hkv, D]
        attn_metadata: AttentionMetadata,
        carry: torch.Tensor | None = None,  # [2, T, hidden] from the previous stage
    ) -> torch.Tensor:  # last stage: [T, hidden], final norm applied; else [2, T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata, carry)

    def compute_logits(  # [N, hidden] -> [N, V]
        self, hidden: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits over the true vocabulary (last stage only), into ``out`` where the
        LM head can write there."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        logits = self.lm_head(hidden, out)
        cap = self.config.final_softcap
        if cap is not None:  # (Gemma 2) s -> cap * tanh(s / cap), in place
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def watch_layers(self, between: Callable[[float], None]) -> None:
        self.model.watch_layers(between)

    def decode_greedy_runs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        later_slots: list[list[int]],
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> list[list[int]] | None:
        head = self.lm_head
        if head is None or self.config.final_softcap is not None:
            return None
        weight = head.greedy_weight(input_ids.shape[0])
        if weight is None:
            return None
        return self.model.decode_greedy_runs(
            input_ids, positions, later_slots, kv_caches, attn_metadata, weight
        )

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N]
        """Each row's greedy token: the argmax of `compute_logits` (one rank only). Capped
        logits are capped first: two raw logits may round to one capped value, and the
        argmax of the capped ones is transformers' token."""
        assert self.lm_head is not None, "only the last pipeline stage has the LM head"
        if self.config.final_softcap is not None:
            return self.compute_logits(hidden).argmax(dim=-1)
        return self.lm_head.greedy(hidden)

    def load_weights(
        self, tensors: Iterable[tuple[str, LoadedTensor]], complete: bool = True
    ) -> None:
        stage_tensors = (
            (target, tensor)
            for name, tensor in tensors
            if (target := self._stage_name(name)) is not None
        )
        load_weights(self, stage_tensors, self.packed_modules_mapping, complete=complete)

    def _stage_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills on this pipeline stage, or None.

        Tensors of other stages' layers (and, under expert parallelism, of other ranks'
        experts) are skipped before they are read. A tied LM head on a
        last stage without the embedding is filled from the embedding's tensor; a tied
        checkpoint's own lm_head.weight (a copy of the embedding) is skipped.
        """
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        if self.config.model_type == "mixtral":
            name = _mixtral_name(name)
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            layer = int(parts[2])  # one beyond the model's layers is kept, so it is refused
            ours = layer in self.model.layer_range
            if ours and parts[3:5] == ["mlp", "experts"] and len(parts) > 5 and parts[5].isdigit():
                mlp = self.model.layers[layer].mlp
                ours = not isinstance(mlp, SparseMoe) or mlp.holds_expert(int(parts[5]))
            return name if ours or layer >= self.config.num_layers else None
        if name.startswith("model.embed_tokens."):
            if self.model.embed_tokens is not None:
                return name
            tied_head = self.config.tie_word_embeddings and self.lm_head is not None
            return "lm_head." + name.removeprefix("model.embed_tokens.") if tied_head else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.lm_head is not None else None
        return name


#: Mixtral's names for its experts' projections, and the Llama names headrace's modules use.
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_name(name: str) -> str:
    """``model.layers.0.block_sparse_moe.experts.3.w1.weight`` ->
    ``model.layers.0.mlp.experts.3.gate_proj.weight`` (the router ``gate`` keeps its name)."""
    parts = name.split(".")
    if len(parts) > 3 and parts[3] == "block_sparse_moe":
        parts[3] = "mlp"
        if len(parts) > 6 and parts[4] == "experts":
            parts[6] = _MIXTRAL_PROJECTIONS.get(parts[6], parts[6])
    return ".".join(parts)
