"""How a worker's ranks split the model, and the collectives the layers call.

A `ParallelConfig` is built once per rank and passed to every layer explicitly, so a layer
knows its shard without any process-global state. Ranks are laid out stage-major: global
rank ``stage * tensor_parallel_size + tp_rank``, so each pipeline stage is a contiguous block
of ranks and forms one tensor-parallel group.

With ``tensor_parallel_size == 1`` every collective returns its input untouched, so TP=1 is
the degenerate case of the same code, not a separate path; with more ranks the collectives go
through the stage's `torch.distributed` group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from headrace.sdk.errors import InvalidArgumentError


class CommTimer:
    """Wall time one rank spends inside collectives and stage-to-stage transfers.

    The benchmark reads it to report the communication share of a step (time a rank waits
    for a slower peer counts too, as it would in any real step). It costs two
    `perf_counter` calls per collective.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    #: How many ranks split each layer's weights.
    tensor_parallel_size: int = 1
    #: This process's rank within the tensor-parallel group, in [0, tensor_parallel_size).
    tensor_parallel_rank: int = 0
    #: How many stages the layers are split into (contiguous ranges, one per stage).
    pipeline_parallel_size: int = 1
    #: This process's stage, in [0, pipeline_parallel_size).
    pipeline_parallel_rank: int = 0
    #: Mixture-of-experts layers give each tensor-parallel rank whole experts (a contiguous
    #: block of them) instead of a slice of every one (`EngineConfig.enable_expert_parallel`).
    expert_parallel: bool = False
    #: The stage's tensor-parallel process group; None means the default (whole world) group,
    #: which is right only when there is a single stage.
    group: Any = field(default=None, compare=False, repr=False)
    #: Time this rank spends communicating (shared by every layer holding this config).
    comm_timer: CommTimer = field(default_factory=CommTimer, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_parallel_sizes(self.tensor_parallel_size, self.pipeline_parallel_size)
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise InvalidArgumentError(
                "tensor_parallel_rank",
                f"must be in [0, {self.tensor_parallel_size}), got {self.tensor_parallel_rank}",
            )
        if not 0 <= self.pipeline_parallel_rank < self.pipeline_parallel_size:
            raise InvalidArgumentError(
                "pipeline_parallel_rank",
                f"must be in [0, {self.pipeline_parallel_size}), got {self.pipeline_parallel_rank}",
            )

    @classmethod
    def for_rank(
        cls,
        rank: int,
        tp_size: int,
        pp_size: int,
        group: Any = None,
        expert_parallel: bool = False,
    ) -> ParallelConfig:
        """The config of global rank ``rank`` in the stage-major layout."""
        return cls(tp_size, rank % tp_size, pp_size, rank // tp_size, expert_parallel, group)

    def whole(self) -> ParallelConfig:
        """This rank's config for a layer it holds whole (an expert under expert
        parallelism): no tensor split, the same stage, no collective."""
        return replace(self, tensor_parallel_size=1, tensor_parallel_rank=0)

    @property
    def is_single(self) -> bool:
        """True when one rank holds whole weights and no collective is needed."""
        return self.tensor_parallel_size == 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def rank(self) -> int:
        """This rank's global rank."""
        return self.pipeline_parallel_rank * self.tensor_parallel_size + self.tensor_parallel_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pipeline_parallel_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pipeline_parallel_rank == self.pipeline_parallel_size - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank holding this rank's tensor-parallel shard in pipeline stage ``stage``."""
        return stage * self.tensor_parallel_size + self.tensor_parallel_rank

    def stage_layers(self, num_layers: int) -> range:
        """The contiguous layers this stage runs; earlier stages take one more when uneven."""
        return stage_layers(num_layers, self.pipeline_parallel_size, self.pipeline_parallel_rank)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_parallel_sizes(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(name, f"must be an integer >= 1, got {value!r}")


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
    with parallel.comm_timer:
        dist.all_reduce(tensor, group=parallel.group)
    return tensor


def all_gather(tensor: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the last dim, in rank order."""
    if parallel.is_single:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(parallel.tensor_parallel_size)]
    with parallel.comm_timer:
        dist.all_gather(parts, tensor.contiguous(), group=parallel.group)
    return torch.cat(parts, dim=-1)
