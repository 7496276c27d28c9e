"""Where new weights come from, and the process group a trainer broadcasts them over.

Design note. An update names its tensors as the Hugging Face checkpoint does and comes from
one of three sources:

- `FromDisk`: a checkpoint folder; each rank reads only its slice of each tensor, exactly as
  at start-up.
- `FromTensors`: named tensors in rank 0's memory (streamed over gRPC, or handed to `LLM`).
  With several ranks, rank 0 broadcasts each tensor over the worker's own gloo group, and
  the other ranks receive it as `FromRankZero`.
- `FromGroup`: a trainer process broadcasts the tensors, in the announced order, over a
  `WeightGroup` that it and every rank of the worker (of every worker, through a router)
  joined beforehand: NCCL on GPU, gloo on CPU.

Every rank receives a broadcast tensor whole and copies only its own slice, in place. The
sources carry their tensors' names, shapes and dtypes (`metas`), so rank 0 checks the whole
update before any rank is told to copy anything.

A `WeightGroup` is a process group of its own, not the default one (each rank of a parallel
worker already has that, with its peers): a `TCPStore` hosted by the trainer (rank 0 of the
group) and a gloo or NCCL process group built on it directly.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.models.weight_check import TensorMeta, checkpoint_metas

#: Prefix of the weights group's keys in the trainer's store.
_STORE_PREFIX = "headrace-weights"
BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, slots=True)
class FromDisk:
    """A safetensors checkpoint folder every rank can read (the same path on each)."""

    path: Path

    def metas(self) -> list[TensorMeta]:
        return checkpoint_metas(self.path)


@dataclass(frozen=True, slots=True)
class FromTensors:
    """Named tensors held by rank 0, in the order they are loaded (and broadcast)."""

    tensors: tuple[tuple[str, torch.Tensor], ...]

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(name, tensor) for name, tensor in self.tensors]


@dataclass(frozen=True, slots=True)
class FromGroup:
    """Tensors the trainer broadcasts over the weights group (src rank 0), in this order."""

    tensors: tuple[TensorMeta, ...]

    def metas(self) -> list[TensorMeta]:
        return list(self.tensors)


@dataclass(frozen=True, slots=True)
class FromRankZero:
    """A `FromTensors` as the other ranks of a parallel worker receive it: each tensor
    broadcast by rank 0 over the worker's own (gloo) group, in this order."""

    tensors: tuple[TensorMeta, ...]


#: What a caller may update from (rank 0 turns `FromTensors` into `FromRankZero` for others).
WeightSource = FromDisk | FromTensors | FromGroup


def weight_source(weights: str | Path | Iterable[tuple[str, torch.Tensor]]) -> WeightSource:
    """A checkpoint folder's path, or (name, tensor) pairs, as a source."""
    if isinstance(weights, str | Path):
        return FromDisk(Path(weights))
    tensors = tuple(weights)
    for i, entry in enumerate(tensors):
        if (
            not isinstance(entry, tuple)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], torch.Tensor)
        ):
            raise InvalidArgumentError("weights", f"entry {i} is not a (name, tensor) pair")
    return FromTensors(tensors)


@dataclass(frozen=True, slots=True)
class WeightGroupSpec:
    """How a worker joins a trainer's weights group; the trainer is rank 0 and hosts the
    rendezvous (a `torch.distributed.TCPStore`) at host:port."""

    host: str
    port: int
    #: The trainer plus every rank of every worker that joins.
    world_size: int
    #: The group rank of this worker's rank 0; its rank r is rank_offset + r.
    rank_offset: int
    #: "gloo" (CPU tensors) or "nccl" (GPU tensors; every member needs a GPU of its own).
    backend: str = "gloo"
    #: How long the rendezvous and each broadcast may take.
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgumentError("host", "must name the trainer's host")
        if not 0 < self.port <= 65535:
            raise InvalidArgumentError("port", f"must be in [1, 65535], got {self.port}")
        if self.world_size < 2:
            raise InvalidArgumentError("world_size", f"must be >= 2, got {self.world_size}")
        if not 1 <= self.rank_offset < self.world_size:
            raise InvalidArgumentError(
                "rank_offset", f"must be in [1, world_size), got {self.rank_offset}"
            )
        if self.backend not in BACKENDS:
            raise InvalidArgumentError(
                "backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.timeout_s <= 0:
            raise InvalidArgumentError("timeout", "must be positive")


class WeightGroup:
    """This process's membership in a trainer's weights group."""

    def __init__(self, process_group: Any, store: Any, rank: int, device: torch.device) -> None:
        self.process_group = process_group
        #: The rendezvous store: the group's connections live as long as it does.
        self.store = store
        self.rank = rank
        #: Where broadcast tensors must live: the GPU for NCCL, else the CPU.
        self.device = device

    @classmethod
    def join(
        cls, host: str, port: int, world_size: int, rank: int, backend: str, timeout_s: float
    ) -> WeightGroup:
        """Meet the other members at host:port (rank 0 hosts the store) and build the group;
        returns once all ``world_size`` members are in."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(_STORE_PREFIX, store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            device = torch.device("cpu")
        member = cls(group, store, rank, device)
        member.barrier()
        return member

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Send ``tensor`` (at src) or fill it (elsewhere), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self.process_group.broadcast([tensor], options).wait()

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self.process_group.allreduce([flag]).wait()

    def close(self) -> None:
        """Leave the group: the process group first, then its store. (Left to interpreter
        exit, the store can go first, and the process then aborts.)"""
        self.process_group = None
        self.store = None

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
