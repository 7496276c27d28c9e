"""The executor interface: what the engine may ask of whatever runs its steps.

The engine submits each scheduled step and later collects its result, oldest first; between
steps, with none in flight, it runs control commands (new weights, memory, LoRA adapters) on
every rank. Three executors implement it (`start_executor` picks one): `UniprocExecutor` runs
a step at submission, `OverlappedExecutor` on a device thread, `DistributedExecutor` across
a tensor/pipeline-parallel worker's ranks. Each hands back an `InFlightStep` whose
``pending`` part only it reads; the engine reads only its ``step``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from headrace.worker.distributed.rank_control import RankCommand
from headrace.worker.execution.batch import StepResult
from headrace.worker.execution.model_runner import ModelRunner
from headrace.worker.lora.manager import LoraManager
from headrace.worker.scheduling.output import SchedulerOutput

#: What an executor keeps of a submitted step until it is collected.
PendingT = TypeVar("PendingT")


@dataclass(slots=True)
class InFlightStep(Generic[PendingT]):
    """A submitted step whose result the engine has not collected yet."""

    step: SchedulerOutput
    #: The executor's own part (a future of the result, rank 0's share of a parallel step).
    pending: PendingT


class Executor(Protocol):
    """Runs the engine's steps and control commands on every rank of the worker."""

    #: Rank 0's model shard (the whole model on one rank): its KV cache's size, the model.
    runner: ModelRunner

    @property
    def lora(self) -> LoraManager | None:
        """Rank 0's LoRA adapters (None: LoRA is off). Read it; change it through `control`
        (`LoadLora`, `UnloadLora`), which changes every rank's."""
        return self.runner.lora

    def submit(self, step: SchedulerOutput) -> InFlightStep[Any]:
        """Start ``step`` (a fault while starting it raises here)."""
        ...

    def collect(self, in_flight: InFlightStep[Any]) -> StepResult:
        """The step's result, once it is ready (a fault in the step raises here). Steps are
        collected in the order they were submitted."""
        ...

    def control(self, command: RankCommand) -> None:
        """Run a control command on every rank; no step may be in flight. Raises
        `RankCommandError` naming the ranks where it failed."""
        ...

    def close(self) -> None:
        """Stop: no step may be in flight, and none may be submitted afterwards."""
        ...

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` just before a fault the worker cannot survive (a rank
        died) ends the process."""
        ...
