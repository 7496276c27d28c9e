"""The Triton backend: a `KernelSet` with the reference module's functions and signatures."""

from headrace.kernels.precision import linear  # cuBLAS: torch's own
from headrace.kernels.reference import (  # torch's
    apply_token_bitmask,
    argmax_update,
    draw_tokens,
    silu_and_mul,
)
from headrace.kernels.triton_attention import paged_attention
from headrace.kernels.triton_cache import write_kv_cache
from headrace.kernels.triton_lora import lora_expand, lora_shrink
from headrace.kernels.triton_norm import rms_norm
from headrace.kernels.triton_quantized import quantized_linear
from headrace.kernels.triton_rotary import apply_rotary

NAME = "triton"

__all__ = [
    "NAME",
    "apply_rotary",
    "apply_token_bitmask",
    "argmax_update",
    "draw_tokens",
    "linear",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "quantized_linear",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]
