"""One typed description of a Llama-family model, read once from its Hugging Face config.

The families differ only in a few switches (which projections carry a bias, per-head q/k
norms, a mixture of experts in place of the MLP, sliding windows; Gemma's norms, scalings,
soft caps and second rope), and transformers versions differ in where
they keep rope parameters (v5: ``config.rope_parameters`` with ``rope_theta`` inside; v4:
``rope_scaling`` plus ``config.rope_theta``). Everything model code needs is settled here,
so the layers never look at an HF config, and anything headrace cannot run exactly fails
here, at load time."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.layers.moe import MoeConfig
from headrace.worker.layers.rotary import SUPPORTED_ROPE_TYPES, RopeConfig

#: The families with a mixture of experts in place of (some) MLPs.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
#: The Gemma families (`worker/models/gemma.py`).
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
#: transformers' activation names -> the gated MLP's (`layers/mlp.py`).
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedModelError(InvalidArgumentError):
    """The checkpoint is a model (or a variant of one) headrace cannot run."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    #: Attention heads and key/value heads of the whole model (not per rank).
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    #: Bias on the q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias).
    qkv_bias: bool
    #: Bias on the attention output projection.
    o_proj_bias: bool
    #: Bias on gate/up/down (Llama's mlp_bias).
    mlp_bias: bool
    #: Qwen3: RMSNorm over each q and k head before rotary.
    qk_norm: bool
    #: The LM head reuses the token embedding matrix.
    tie_word_embeddings: bool
    rope: RopeConfig
    #: The mixture of experts in place of the MLP (of the layers it names); None: dense.
    moe: MoeConfig | None = None
    #: The sliding-window layers' window: the keys a token sees, its own included (None: no
    #: layer has one). Every layer but those in full_attention_layers keeps to it.
    sliding_window: int | None = None
    full_attention_layers: frozenset[int] = frozenset()
    #: The gated MLP's activation: "silu" (Llama) or "gelu_tanh" (Gemma).
    activation: str = "silu"
    #: Gemma: the attention scores' scale is query_pre_attn_scalar ** -0.5, not head_dim's.
    query_pre_attn_scalar: float | None = None
    #: Gemma 2: attention scores and final logits soft-capped (s -> cap * tanh(s / cap)).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: Gemma 3: the sliding-window layers' own rope (None: every layer uses ``rope``).
    local_rope: RopeConfig | None = None
    #: GPT-OSS: a learned logit per attention head in its softmax's denominator.
    attention_sinks: bool = False

    @property
    def is_gemma(self) -> bool:
        """Gemma's decoder: (1 + w) norms, four per layer, embeddings scaled by sqrt(hidden)."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s window, or None where it attends to the whole sequence."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window every layer keeps to, so the KV behind it is never read again; None
        where some layer sees the whole sequence."""
        return None if self.full_attention_layers else self.sliding_window

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        model_type = str(hf_config.model_type)
        sliding_window, full_attention_layers = windows_from_hf(hf_config)
        num_heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            max_position_embeddings=int(hf_config.max_position_embeddings),
            # Qwen2 hard-codes biased q/k/v and an unbiased o_proj; its config has no switch
            # (Qwen2-MoE's has: qkv_bias).
            qkv_bias=model_type == "qwen2"
            or (model_type == "qwen2_moe" and bool(getattr(hf_config, "qkv_bias", True)))
            or attention_bias,
            o_proj_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope=rope_config_from_hf(hf_config, head_dim),
            moe=moe_config_from_hf(hf_config) if model_type in MOE_MODEL_TYPES else None,
            sliding_window=sliding_window,
            full_attention_layers=full_attention_layers,
            activation=activation_from_hf(hf_config),
            attention_sinks=model_type == "gpt_oss",
            **(gemma_switches(hf_config, head_dim) if model_type in GEMMA_MODEL_TYPES else {}),
        )


def gemma_switches(hf_config: Any, head_dim: int) -> dict[str, Any]:
    """Gemma's scale and caps as transformers applies them: Gemma 3's attention ignores an
    ``attn_logit_softcapping``; its sliding layers have a rope of their own."""
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention is not supported")
    gemma2 = str(hf_config.model_type) == "gemma2"
    attn_softcap = getattr(hf_config, "attn_logit_softcapping", None) if gemma2 else None
    final_softcap = getattr(hf_config, "final_logit_softcapping", None)
    return {
        "query_pre_attn_scalar": float(hf_config.query_pre_attn_scalar),
        "attn_softcap": None if attn_softcap is None else float(attn_softcap),
        "final_softcap": None if final_softcap is None else float(final_softcap),
        "local_rope": None if gemma2 else rope_config_from_hf(hf_config, head_dim, "sliding"),
    }


def activation_from_hf(hf_config: Any) -> str:
    """Gemma names it ``hidden_activation``, the others ``hidden_act``."""
    name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    if name not in ACTIVATIONS:
        supported = ", ".join(repr(a) for a in ACTIVATIONS)
        raise UnsupportedModelError(f"activation {name!r} is not supported ({supported})")
    return ACTIVATIONS[name]


def windows_from_hf(hf_config: Any) -> tuple[int | None, frozenset[int]]:
    """The sliding window and the layers that attend fully despite it, as transformers reads
    them: a ``layer_types`` list names each layer's kind (Qwen2/3, Qwen2-MoE; they drop the
    window unless ``use_sliding_window``); without one, a window applies to every layer
    (Mistral, Mixtral, Qwen3-MoE). A window no sequence can outgrow is no window."""
    window = getattr(hf_config, "sliding_window", None)
    num_layers = int(hf_config.num_hidden_layers)
    if window is None or window >= int(hf_config.max_position_embeddings):
        return None, frozenset()
    layer_types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * num_layers
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    full = frozenset(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if len(full) < num_layers and int(window) < 1:
        raise UnsupportedModelError(f"sliding_window {window} is not a positive length")
    return (None, frozenset()) if len(full) == num_layers else (int(window), full)


def moe_config_from_hf(hf_config: Any) -> MoeConfig | None:
    """Mixtral: every layer sparse, experts of ``intermediate_size``, always renormalised.
    GPT-OSS: the same sizes, its biased router and experts (`layers/moe.py`). Qwen2/3-MoE:
    ``moe_intermediate_size`` experts, ``norm_topk_prob``, dense layers where
    ``mlp_only_layers`` or ``decoder_sparse_step`` say, and Qwen2-MoE's shared expert."""
    num_layers = int(hf_config.num_hidden_layers)
    num_experts = int(getattr(hf_config, "num_local_experts", None) or hf_config.num_experts)
    top_k = int(hf_config.num_experts_per_tok)
    if num_experts == 0:
        return None  # Qwen's switch for a dense model
    if str(hf_config.model_type) == "mixtral":
        return MoeConfig(num_experts, top_k, int(hf_config.intermediate_size), renormalize=True)
    if str(hf_config.model_type) == "gpt_oss":
        quantization = getattr(hf_config, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method is not None:
            raise UnsupportedModelError(f"GPT-OSS quantized as {method!r} is not supported")
        return MoeConfig(
            num_experts,
            top_k,
            int(hf_config.intermediate_size),
            renormalize=False,  # (the softmax over the top k sums to 1 already)
            softmax_after_top_k=True,
            router_bias=True,
            expert_bias=True,
            activation="swiglu_oai",
            swiglu_alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(hf_config.swiglu_limit),
        )
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(hf_config, "mlp_only_layers", None) or ())
    dense = {i for i in range(num_layers) if i in only_mlp or (i + 1) % step}
    return MoeConfig(
        num_experts,
        top_k,
        int(hf_config.moe_intermediate_size),
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
        dense_layers=frozenset(dense),
    )


def rope_config_from_hf(
    hf_config: Any, head_dim: int, layers: Literal["full", "sliding"] = "full"
) -> RopeConfig:
    """Rope parameters from either config layout (see the module docstring); where they are
    given per layer type (Gemma 3), those of the full or the sliding-window layers."""
    params: dict[str, Any] = dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )
    if any(isinstance(value, dict) for value in params.values()):
        if str(hf_config.model_type) != "gemma3_text":  # (the one family with a local rope)
            raise UnsupportedModelError("per-layer-type rope parameters are not supported")
        if f"{layers}_attention" not in params:
            raise UnsupportedModelError(f"rope parameters lack {layers}_attention")
        params = dict(params[f"{layers}_attention"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {supported})"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial rotary (factor {partial}) is not supported")
    max_position = int(hf_config.max_position_embeddings)
    theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0))
    if rope_type == "default":
        return RopeConfig(head_dim, max_position, theta)
    if rope_type == "longrope":
        return _longrope_config(hf_config, params, head_dim, max_position, theta)
    if rope_type == "yarn":
        return _yarn_config(hf_config, params, head_dim, max_position, theta)
    factor = float(_rope_param(params, "factor"))
    if rope_type == "linear":
        return RopeConfig(head_dim, max_position, theta, "linear", factor)
    original = _original_max_position(hf_config, params)
    return RopeConfig(
        head_dim,
        max_position,
        theta,
        "llama3",
        factor,
        low_freq_factor=float(_rope_param(params, "low_freq_factor")),
        high_freq_factor=float(_rope_param(params, "high_freq_factor")),
        original_max_position=int(original),
    )


def _longrope_config(
    hf_config: Any, params: dict[str, Any], head_dim: int, max_position: int, theta: float
) -> RopeConfig:
    """Phi-3's longrope within its original context: the short factors, and cos/sin scaled
    by the attention factor (transformers' default: sqrt(1 + ln(factor) / ln(original))).
    Past the original context transformers switches every frequency to the long factors
    for whole forward passes at once, so a token's rotation would depend on how its
    sequence was batched; `context_length` keeps headrace inside the original context."""
    original = int(_original_max_position(hf_config, params))
    short = tuple(float(f) for f in _rope_param(params, "short_factor"))
    if len(short) != head_dim // 2:
        raise UnsupportedModelError(
            f"longrope short_factor has {len(short)} entries, not {head_dim // 2}"
        )
    factor = float(params.get("factor") or max_position / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        )
    return RopeConfig(
        head_dim,
        min(max_position, original),
        theta,
        "longrope",
        ext_factors=short,
        attention_factor=float(attention_factor),
    )


def _yarn_config(
    hf_config: Any, params: dict[str, Any], head_dim: int, max_position: int, theta: float
) -> RopeConfig:
    """YaRN as transformers reads it (GPT-OSS): the attention factor 0.1 ln(factor) + 1
    unless given; DeepSeek's mscale pair is not supported."""
    if params.get("mscale") and params.get("mscale_all_dim"):
        raise UnsupportedModelError("yarn with mscale / mscale_all_dim is not supported")
    original = int(_rope_param(params, "original_max_position_embeddings"))
    factor = float(params.get("factor") or max_position / original)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return RopeConfig(
        head_dim,
        max_position,
        theta,
        "yarn",
        factor,
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def context_length(hf_config: Any) -> int:
    """The positions headrace runs exactly: the model's, or a longrope model's original
    context (see `_longrope_config`)."""
    max_position = int(hf_config.max_position_embeddings)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "longrope":
        return min(max_position, int(_original_max_position(hf_config, params)))
    return max_position


def _original_max_position(hf_config: Any, params: dict[str, Any]) -> Any:
    """As transformers reads it: a top-level original_max_position_embeddings wins."""
    return getattr(hf_config, "original_max_position_embeddings", None) or params.get(
        "original_max_position_embeddings", hf_config.max_position_embeddings
    )


def _rope_param(params: dict[str, Any], key: str) -> Any:
    if key not in params:
        raise UnsupportedModelError(f"rope parameters lack {key!r}")
    return params[key]
