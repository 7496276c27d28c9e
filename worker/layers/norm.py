"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer."""

from __future__ import annotations

import torch
from headrace.kernels import KernelSet
from headrace.worker.layers.weights import new_parameter
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, kernels: KernelSet, *, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = new_parameter((hidden_size,), dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [..., hidden] -> (normed, new residual)
        """Add ``residual`` to ``x`` (when given), then normalise the sum.

        Returns the normalised tensor and the sum, which is the residual for the next block;
        without ``residual`` the sum is ``x`` itself, so every decoder layer reads the same.
        """
        return self.kernels.rms_norm(x, self.weight, self.eps, residual)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        return self.kernels.rms_norm(x, self.weight, self.eps)[0]
