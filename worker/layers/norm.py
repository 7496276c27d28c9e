"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Gemma's checkpoints store each norm's weight as an offset from 1 (the norm multiplies by
``1 + w``): ``weight_offset=1`` adds it as the weight loads, in float32 as transformers does,
so the kernels see an ordinary weight.
"""

from __future__ import annotations

import torch
from headrace.kernels import KernelSet
from headrace.worker.layers.weights import (
    LoadedTensor,
    ShardId,
    check_shape,
    default_weight_loader,
    new_parameter,
    read,
)
from torch import nn


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float,
        kernels: KernelSet,
        *,
        dtype: torch.dtype | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight_offset = weight_offset
        loader = self._load_offset if weight_offset else default_weight_loader
        self.weight = new_parameter((hidden_size,), dtype, loader)

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

    def _load_offset(self, param: nn.Parameter, loaded: LoadedTensor, shard_id: ShardId) -> None:
        assert shard_id is None, f"unexpected shard {shard_id!r} for a norm"
        check_shape(loaded, param.shape)
        param.copy_(read(loaded).float() + self.weight_offset)
