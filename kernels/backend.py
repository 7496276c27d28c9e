"""Which kernels a model runs: Triton on CUDA, C kernels on the CPU, torch references anywhere.

A backend is a module with the functions of `KernelSet`: `headrace.kernels.reference` (plain
torch, any device; every other backend's oracle), `headrace.kernels.triton_ops` (Triton;
CUDA, or the CPU under ``TRITON_INTERPRET=1``) and `headrace.kernels.cpu_ops` (C kernels
compiled on the machine, see `headrace.kernels.native`). The engine picks one at start-up and
hands it to every layer, so there is no process-global kernel switch.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.lora import LoraIndices
from headrace.kernels.quantized import QuantizedWeight

#: The values of EngineConfig.kernel_backend / ``--kernel-backend``: which kernel set runs
#: the model and the sampler (attention, matmuls, norms, rotary, LoRA, the draw, the grammar
#: masks, the greedy head's argmax).
BACKEND_NAMES = ("auto", "triton", "cpu", "reference")


class KernelSet(Protocol):
    #: "triton", "cpu" or "reference".
    NAME: str

    def write_kv_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None: ...

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys a query sees, its own included; None: all
        softcap: float | None = None,  # scores s -> softcap * tanh(s / softcap); None: as is
        sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head, no value
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]

    def rms_norm(
        self,
        x: torch.Tensor,  # [..., hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (normed, x + residual)

    def apply_rotary(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(
        self,
        gate_up: torch.Tensor,  # [T, 2 * intermediate]: the gate's columns, then up's
    ) -> torch.Tensor: ...  # [T, intermediate]: silu(gate) * up

    def linear(
        self,
        x: torch.Tensor,  # [T, in]
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None = None,  # [out]
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # [T, out] in out_dtype (default: x's dtype)

    def quantized_linear(
        self,
        x: torch.Tensor,  # [T, in]
        weight: QuantizedWeight,  # [out, in] as integers in groups (kernels/quantized.py)
        bias: torch.Tensor | None = None,  # [out]
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # [T, out]: x against the dequantized weight, summed in float32

    def lora_shrink(
        self,
        x: torch.Tensor,  # [T, in]
        lora_a: torch.Tensor,  # [S, R, in]: every adapter slot's A
        indices: LoraIndices,
    ) -> torch.Tensor: ...  # [T, R]: x A_sᵀ per row, zero for base rows

    def lora_expand(
        self,
        h: torch.Tensor,  # [T, R]
        lora_b: torch.Tensor,  # [S, R, out]: every adapter slot's Bᵀ, scaling folded in
        indices: LoraIndices,
        y: torch.Tensor,  # [T, Y]: y[:, offset:offset + out] += h B_s in place
        offset: int,
    ) -> None: ...

    def draw_tokens(
        self,
        logits: torch.Tensor,  # [S, V] float32 (top-k applied as -inf)
        temperature: torch.Tensor,  # [S] float32, > 0
        top_p_floor: torch.Tensor,  # [S] float32: 1 - top_p (<= 0: no top-p)
        min_p: torch.Tensor,  # [S] float32
        keys: torch.Tensor,  # [S, 2] int64: (odd multiplier, offset) of each row's noise
    ) -> torch.Tensor: ...  # [S] int64: each row's seeded Gumbel-max draw

    def apply_token_bitmask(
        self,
        x: torch.Tensor,  # [B, V] float32: -inf where a row's bitmask forbids, in place
        bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32: bit t % 32 of word t / 32 = token t
        rows: list[int],  # [R]: the row of x of each bitmask row
    ) -> None: ...

    def argmax_update(
        self,
        x: torch.Tensor,  # [N, C] float32: columns [offset, offset + C) of every row
        offset: int,
        best: torch.Tensor,  # [N] float32: each row's running maximum, in place
        index: torch.Tensor,  # [N] int64: its first column, in place
    ) -> None: ...


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_device_error(device: torch.device) -> str:
    """Why Triton cannot run on ``device``."""
    return f"triton needs a CUDA device (or TRITON_INTERPRET=1), not {device.type}"


def select_kernels(name: str, device: torch.device) -> KernelSet:
    """The backend called ``name``. "auto": Triton on CUDA; on the CPU the C kernels, or the
    references where they cannot be built (no compiler); the references on other devices.

    Raises ValueError for an unknown name, Triton without CUDA or its interpreter, or "cpu"
    off the CPU or without its kernels; `EngineConfig` checks the first two, so users see an
    error naming the field."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}")
    if name == "auto":
        name = {"cuda": "triton", "cpu": "cpu"}.get(device.type, "reference")
        if name == "cpu" and not _cpu_kernels_available():
            name = "reference"
    if name == "cpu":
        return _cpu_kernels(device)
    if name == "reference":
        from headrace.kernels import reference

        return reference
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(triton_device_error(device))
    from headrace.kernels import triton_ops

    return triton_ops


def _cpu_kernels_available() -> bool:
    from headrace.kernels import cpu_ops

    return cpu_ops.available()


def cpu_kernels_error(device: torch.device) -> str | None:
    """Why the "cpu" backend cannot run on ``device`` (None if it can); builds it if needed."""
    from headrace.kernels import native

    if device.type != "cpu":
        return f"the cpu kernels run on the CPU, not {device.type}"
    if not _cpu_kernels_available():
        return f"the cpu kernels could not be built: {native.build_error()}"
    return None


def _cpu_kernels(device: torch.device) -> KernelSet:
    from headrace.kernels import cpu_ops

    error = cpu_kernels_error(device)
    if error is not None:
        raise ValueError(error)
    return cpu_ops
