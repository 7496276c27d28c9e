"""Tensor-parallel configuration and the collectives the layers call.

A `ParallelConfig` is built once and passed to every layer explicitly, so a layer knows its
shard without any process-global state. With ``tensor_parallel_size == 1`` every collective
returns its input untouched, so TP=1 is the degenerate case of the same code, not a
separate path; with more ranks the collectives go through an already-initialised
`torch.distributed` process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from headrace.sdk.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    #: How many ranks split each layer's weights.
    tensor_parallel_size: int = 1
    #: This process's rank within the tensor-parallel group, in [0, tensor_parallel_size).
    tensor_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise InvalidArgumentError(
                "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
            )
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise InvalidArgumentError(
                "tensor_parallel_rank",
                f"must be in [0, {self.tensor_parallel_size}), got {self.tensor_parallel_rank}",
            )

    @property
    def is_single(self) -> bool:
        """True when one rank holds whole weights and no collective is needed."""
        return self.tensor_parallel_size == 1


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, which must divide exactly (``what`` names the quantity)."""
    if numerator % denominator:
        raise InvalidArgumentError(
            "tensor_parallel_size",
            f"{what} ({numerator}) is not divisible by {denominator}",
        )
    return numerator // denominator


def all_reduce(tensor: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum of ``tensor`` over the tensor-parallel ranks (in place when there are several)."""
    if parallel.is_single:
        return tensor
    dist.all_reduce(tensor)
    return tensor


def all_gather(tensor: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dim, in rank order."""
    if parallel.is_single:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(parallel.tensor_parallel_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts, dim=-1)
