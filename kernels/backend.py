"""Which kernels a model runs: Triton on CUDA, the torch references elsewhere.

A backend is a module with the functions of `KernelSet`: `headrace.kernels.reference` (plain
torch, any device) and `headrace.kernels.triton_ops` (Triton; CUDA, or the CPU under
``TRITON_INTERPRET=1``). The engine picks one at start-up and hands it to every layer, so
there is no process-global kernel switch.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
from headrace.kernels.attention import AttentionMetadata

#: The values of EngineConfig.attention_backend / ``--attention-backend``.
BACKEND_NAMES = ("auto", "triton", "reference")


class KernelSet(Protocol):
    #: "triton" or "reference".
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


def triton_interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_device_error(device: torch.device) -> str:
    """Why Triton cannot run on ``device``."""
    return f"triton needs a CUDA device (or TRITON_INTERPRET=1), not {device.type}"


def select_kernels(name: str, device: torch.device) -> KernelSet:
    """The backend called ``name`` ("auto": Triton on CUDA, the references elsewhere).

    Raises ValueError for an unknown name, or Triton without CUDA or its interpreter;
    `EngineConfig` checks both first, so users see an error naming the field."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "reference":
        from headrace.kernels import reference

        return reference
    if device.type != "cuda" and not triton_interpreted():
        raise ValueError(triton_device_error(device))
    from headrace.kernels import triton_ops

    return triton_ops
