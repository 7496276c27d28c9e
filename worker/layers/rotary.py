"""Rotary position embedding, neox style (rotate halves) as in Hugging Face Llama.

The inverse frequencies are computed exactly as `transformers.modeling_rope_utils` does for
the supported rope types (same float32 ops in the same order), and cos/sin are precomputed
once for every position up to max_position_embeddings. Applying them to queries and keys is a
kernel (`KernelSet.apply_rotary`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

RopeType = Literal["default", "linear", "llama3", "longrope", "yarn"]
SUPPORTED_ROPE_TYPES: tuple[RopeType, ...] = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """The rope parameters of one model, already read out of its HF config."""

    head_dim: int
    #: Positions [0, max_position) get a precomputed cos/sin row.
    max_position: int
    #: The base wavelength (rope_theta).
    theta: float
    rope_type: RopeType = "default"
    #: linear, llama3 and yarn: how much the context was stretched.
    factor: float = 1.0
    #: llama3 only: the wavelength band that is smoothly interpolated.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    #: llama3 and yarn: the pretraining context length.
    original_max_position: int = 8192
    #: yarn only: the rotation counts bounding the blend of scaled and unscaled frequencies,
    #: and whether the blend's dimension bounds are rounded out to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    #: longrope (Phi-3) only: each frequency's divisor (the short factors: headrace runs a
    #: longrope model within its original context).
    ext_factors: tuple[float, ...] = ()
    #: longrope and yarn: the factor cos and sin are scaled by.
    attention_factor: float = 1.0


def compute_inv_freq(config: RopeConfig) -> torch.Tensor:  # [head_dim // 2] float32
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (config.theta**exponents)
    if config.rope_type == "linear":
        return inv_freq / config.factor
    if config.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, config)
    if config.rope_type == "longrope":  # (transformers' op order: 1 / (ext * base ** e))
        ext_factors = torch.tensor(config.ext_factors, dtype=torch.float32)
        return 1.0 / (ext_factors * config.theta**exponents)
    if config.rope_type == "yarn":
        return _yarn_inv_freq(config)
    return inv_freq


def _yarn_inv_freq(config: RopeConfig) -> torch.Tensor:
    """YaRN: fast-rotating dimensions keep their frequency, slow ones are divided by
    ``factor``, with a linear ramp between (transformers' _compute_yarn_parameters, op for
    op)."""
    dim, base = config.head_dim, config.theta
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (config.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        rotations = config.original_max_position / (num_rotations * 2 * math.pi)
        return (dim * math.log(rotations)) / (2 * math.log(base))

    low, high = correction_dim(config.beta_fast), correction_dim(config.beta_slow)
    if config.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, config: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend between (transformers' _compute_llama3_parameters, op for op)."""
    factor = config.factor
    low_freq_factor = config.low_freq_factor
    high_freq_factor = config.high_freq_factor
    old_context_len = config.original_max_position
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * scaled / factor + smooth_factor * scaled
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU in float32 (as HF builds inv_freq), then moved to the default device;
        # kept float32 and cast per use, so a bf16 model rotates with the same rounded values.
        inv_freq = compute_inv_freq(config)
        positions = torch.arange(config.max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_position, head_dim]
        device = torch.get_default_device()
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        cos, sin = angles.cos(), angles.sin()
        if config.attention_factor != 1.0:
            cos, sin = cos * config.attention_factor, sin * config.attention_factor
        # [max_position, 1, head_dim]: a step's rows come out in the shape layers take
        self.register_buffer("cos_cache", cos[:, None].contiguous().to(device), persistent=False)
        self.register_buffer("sin_cache", sin[:, None].contiguous().to(device), persistent=False)
        #: The caches cast to another dtype (the same rounded values a cast per step makes),
        #: made on first use, so a step looks its rows up in one operation each.
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T] -> cos, sin: [T, 1, head_dim]
        """cos and sin for each token, looked up once per step and shared by every layer."""
        cos, sin = self.tables(dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position ([positions, 1, head_dim]) in ``dtype``."""
        if dtype == self.cos_cache.dtype:
            return self.cos_cache, self.sin_cache
        cast = self._cast.get(dtype)
        if cast is None or cast[0].device != self.cos_cache.device:
            cast = self._cast[dtype] = (self.cos_cache.to(dtype), self.sin_cache.to(dtype))
        return cast
