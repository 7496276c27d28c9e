"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch
from headrace.worker.layers.weights import new_parameter
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [..., hidden] -> (normed, new residual)
        """Add ``residual`` to ``x`` (when given), then normalise the sum.

        Returns the normalised tensor and the sum, which is the residual for the next block;
        without ``residual`` the sum is ``x`` itself, so every decoder layer reads the same.
        """
        if residual is not None:
            # Added in the activation dtype, as Hugging Face does, so bf16 results agree.
            x = x + residual
        return self.normalize(x), x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        # Statistics in float32; cast back before the weight, matching HF LlamaRMSNorm.
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)
