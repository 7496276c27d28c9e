"""Control commands every rank of a worker runs: load new weights, join a trainer's weights
group, release and restore memory, load and unload LoRA adapters.

Design note. A command travels like a step plan: rank 0 sends it to every other rank
point-to-point, between steps and with no step in flight, so all ranks see steps and
commands in one order. Each rank applies it to its own shard (`RankControl.apply`, rank 0
included); then the ranks gather their outcomes, so rank 0 learns of a failure on any rank
and the command is over everywhere at once. A rank that fails partway (a file it cannot
read, a tensor it cannot copy) still takes part in every remaining broadcast of the command,
so no other rank is left waiting in a collective. The checks that can refuse an update
happen on rank 0 before the command is sent (`WeightChecker`); what fails here fails after
copying began.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.distributed.weight_sync import (
    FromDisk,
    FromRankZero,
    FromTensors,
    WeightGroup,
    WeightGroupSpec,
    WeightSource,
)
from headrace.worker.execution.model_runner import ModelRunner
from headrace.worker.models.loader import iter_weights
from headrace.worker.models.weight_check import TensorMeta

#: Rank 0 broadcasts `FromTensors` from itself.
_RANK_ZERO = 0


@dataclass(frozen=True, slots=True)
class LoadWeights:
    """Copy new weights into every parameter, in place."""

    source: WeightSource | FromRankZero


@dataclass(frozen=True, slots=True)
class JoinWeightGroup:
    """Join a trainer's weights group (replacing any group joined before)."""

    spec: WeightGroupSpec


@dataclass(frozen=True, slots=True)
class ReleaseMemory:
    """Free the KV cache; with offload_weights, move the weights to host memory."""

    offload_weights: bool


@dataclass(frozen=True, slots=True)
class RestoreMemory:
    """Undo `ReleaseMemory`."""


@dataclass(frozen=True, slots=True)
class LoadLora:
    """Read a LoRA adapter (checked on rank 0 first) into this rank's pool."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadLora:
    name: str


RankCommand = LoadWeights | JoinWeightGroup | ReleaseMemory | RestoreMemory | LoadLora | UnloadLora


class RankCommandError(Exception):
    """A command failed on one or more ranks; the message says where and why."""


def for_other_ranks(command: RankCommand) -> RankCommand:
    """The command as ranks other than 0 run it: in-memory tensors come by broadcast."""
    if isinstance(command, LoadWeights) and isinstance(command.source, FromTensors):
        return LoadWeights(FromRankZero(tuple(command.source.metas())))
    return command


class RankControl:
    """One rank's side of the control commands: its model shard, its KV cache and its
    membership in a trainer's weights group."""

    def __init__(self, runner: ModelRunner, parallel: ParallelConfig, plan_group: Any) -> None:
        self.runner = runner
        self.parallel = parallel
        #: The worker's own gloo group over all its ranks (None with a single rank).
        self.plan_group = plan_group
        self.weight_group: WeightGroup | None = None

    def close(self) -> None:
        """Leave the weights group, if any (at shutdown)."""
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None

    def run(self, command: RankCommand) -> str | None:
        """Apply ``command``; returns why it failed on this rank (None: it did not)."""
        try:
            self.apply(command)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def run_everywhere(self, command: RankCommand) -> None:
        """Apply ``command`` here, then learn every rank's outcome; raises if any failed."""
        outcomes: list[str | None] = [None] * self.parallel.world_size
        local = self.run(command)
        if self.parallel.world_size > 1:
            dist.all_gather_object(outcomes, local, group=self.plan_group)
        else:
            outcomes[0] = local
        failures = [f"rank {rank}: {error}" for rank, error in enumerate(outcomes) if error]
        if failures:
            raise RankCommandError("; ".join(failures))

    def apply(self, command: RankCommand) -> None:
        if isinstance(command, LoadWeights):
            self._load(command.source)
        elif isinstance(command, JoinWeightGroup):
            self._join(command.spec)
        elif isinstance(command, ReleaseMemory):
            self.runner.release_memory(command.offload_weights)
        elif isinstance(command, LoadLora | UnloadLora):
            lora = self.runner.lora
            assert lora is not None, "LoRA commands need LoRA enabled"
            if isinstance(command, LoadLora):
                lora.add(command.name, command.path)
            else:
                lora.remove(command.name)
        else:
            self.runner.restore_memory()

    # --- weights ----------------------------------------------------------------------

    @torch.inference_mode()
    def _load(self, source: WeightSource | FromRankZero) -> None:
        model = self.runner.model
        if isinstance(source, FromDisk):
            model.load_weights(iter_weights(source.path))
        elif isinstance(source, FromTensors) and self.parallel.world_size == 1:
            model.load_weights(source.tensors)
        elif isinstance(source, FromTensors):
            tensors = [tensor.to("cpu").contiguous() for _, tensor in source.tensors]
            self._receive_all(source.metas(), self._plan_broadcast, tensors)
        elif isinstance(source, FromRankZero):
            self._receive_all(source.tensors, self._plan_broadcast)
        else:
            group = self.weight_group
            if group is None:
                raise RuntimeError("this rank has joined no weights group")
            self._receive_all(source.tensors, group.broadcast, device=group.device)

    def _plan_broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, _RANK_ZERO, group=self.plan_group)

    def _receive_all(
        self,
        metas: Sequence[TensorMeta],
        broadcast: Callable[[torch.Tensor], None],
        sent: Sequence[torch.Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Take part in one broadcast per tensor (sending ``sent`` where given), copying each
        received tensor's slice as it arrives. A copy that fails does not stop the
        broadcasts: every rank joins all of them, then the first failure is raised."""
        failure: Exception | None = None
        for i, meta in enumerate(metas):
            if sent is not None:
                tensor = sent[i]
            else:
                tensor = torch.empty(meta.shape, dtype=meta.dtype, device=device or "cpu")
            broadcast(tensor)
            if failure is None:
                try:
                    self.runner.model.load_weights([(meta.name, tensor)], complete=False)
                except Exception as exc:
                    failure = exc
        if failure is not None:
            raise failure

    def _join(self, spec: WeightGroupSpec) -> None:
        if self.weight_group is not None:  # a new group replaces the old one
            self.weight_group.close()
            self.weight_group = None
        rank = spec.rank_offset + self.parallel.rank
        self.weight_group = WeightGroup.join(
            spec.host, spec.port, spec.world_size, rank, spec.backend, spec.timeout_s
        )
