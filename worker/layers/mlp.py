"""The gated MLP: down(act(gate(x)) * up(x)), act SiLU (Llama) or tanh-approximated GELU
(Gemma); or GPT-OSS's clamped SwiGLU, down((clamp(up) + 1) * g * sigmoid(1.702 g)) with
g = gate clamped from above (``swiglu_limit``), the up clamped both ways (1.702 is the
config's ``swiglu_alpha``).

gate and up are one column-parallel matmul (`MergedColumnParallelLinear`), down is
row-parallel, so the block costs one all-reduce, or none with ``reduce_results=False`` (a
mixture-of-experts block sums its experts' partials first, `layers/moe.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from headrace.kernels import KernelSet
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from torch import nn


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
        reduce_results: bool = True,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.swiglu_alpha = swiglu_alpha
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
            reduce_results=reduce_results,
        )
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2 x intermediate per rank]
        if self.activation == "silu":
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        limit = self.swiglu_limit  # "swiglu_oai", as transformers' GptOssExperts computes it
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
        return self.down_proj((up + 1) * glu)
