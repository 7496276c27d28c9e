"""Runs scheduled steps: on one process, or across a tensor/pipeline-parallel worker's ranks.

`start_executor` is the one place the engine builds its model: with a single rank it loads the
model here and the `ModelRunner` executes steps directly; with several it hands over to
`distributed.executor`, which starts the other ranks. Either way the engine submits steps and
collects their results in order. On one rank a step's result is ready at submission, unless
`EngineConfig.overlap_steps` is set: then submission builds the step's batch and a device thread
runs it (forward, LM head), while the engine goes on with the host's work of other steps.
Between steps it runs control commands (new weights, memory release) on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from headrace.kernels import KernelSet
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.executor import DistributedExecutor, PendingStep, start_distributed
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.distributed.rank_control import RankCommand, RankControl
from headrace.worker.execution.batch import StepResult
from headrace.worker.execution.host_memory import keep_freed_memory
from headrace.worker.execution.kv_cache import kv_cache_blocks
from headrace.worker.execution.model_runner import ModelRunner
from headrace.worker.lora.manager import start_lora
from headrace.worker.models.registry import load_model
from headrace.worker.scheduling.output import SchedulerOutput
from torch import nn


@dataclass(slots=True)
class InFlightStep:
    """A submitted step whose result the engine has not collected yet."""

    step: SchedulerOutput
    #: The whole result, on a single rank (it ran at submission).
    result: StepResult | None = None
    #: Rank 0's part of a step running across ranks.
    pending: PendingStep | None = None
    #: The step on the device thread (one rank with overlap_steps).
    running: Future[StepResult] | None = None


@dataclass(slots=True)
class Executor:
    """What the engine drives: rank 0's model shard, and how to run a whole step."""

    #: Rank 0's shard (the whole model with a single rank).
    runner: ModelRunner
    parallel: ParallelConfig
    #: Set when the worker has other ranks.
    distributed: DistributedExecutor | None = None
    #: Runs submitted steps' device work in order (one rank with overlap_steps), else None.
    device_thread: ThreadPoolExecutor | None = None
    #: Rank 0's side of control commands (on one rank, the only side).
    rank_control: RankControl = field(init=False)

    def __post_init__(self) -> None:
        if self.distributed is not None:
            self.rank_control = self.distributed.rank_control
        else:
            self.rank_control = RankControl(self.runner, self.parallel, None)

    def submit(self, step: SchedulerOutput) -> InFlightStep:
        if self.distributed is not None:
            return InFlightStep(step, pending=self.distributed.submit(step))
        if self.device_thread is not None:
            batch = self.runner.prepare(step.chunks)  # now: it reads what the engine changes
            running = self.device_thread.submit(self.runner.run, step.block_copies, batch)
            return InFlightStep(step, running=running)
        return InFlightStep(step, result=self.runner.execute(step))

    def collect(self, in_flight: InFlightStep) -> StepResult:
        """The step's result (a step that failed raises its error here); steps must be
        collected in the order they were submitted."""
        if in_flight.result is not None:
            return in_flight.result
        if in_flight.running is not None:
            return in_flight.running.result()
        assert self.distributed is not None and in_flight.pending is not None
        return self.distributed.collect(in_flight.pending)

    def control(self, command: RankCommand) -> None:
        """Run a control command (new weights, memory) on every rank; no step may be in
        flight. Raises `RankCommandError` naming the ranks where it failed."""
        if self.distributed is not None:
            self.distributed.control(command)
        else:
            self.rank_control.run_everywhere(command)

    def close(self) -> None:
        if self.device_thread is not None:
            self.device_thread.shutdown()
            self.device_thread = None
        self.rank_control.close()
        if self.distributed is not None:
            self.distributed.close()
            self.distributed = None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` just before a rank failure ends the process (a single
        rank has no such failure: a fault in its step fails the step's requests only)."""
        if self.distributed is not None:
            self.distributed.on_failure(callback)


def start_executor(
    config: EngineConfig,
    model_path: Path,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelSet,
    max_model_len: int,
    hf_config: Any,
) -> Executor:
    if config.world_size > 1:
        distributed = start_distributed(config, model_path, dtype, device, max_model_len, hf_config)
        return Executor(distributed.shard.runner, distributed.shard.parallel, distributed)
    if device.type == "cpu":
        keep_freed_memory()
    loaded = load_model(model_path, dtype, device, kernels=kernels)
    lora = start_lora(cast(nn.Module, loaded.model), kernels, config)  # before sizing the cache
    num_blocks = kv_cache_blocks(config, loaded.model, device, dtype, max_model_len)
    runner = ModelRunner(
        loaded.model,
        device,
        dtype,
        config.block_size,
        num_blocks,
        lora=lora,
        num_logits_buffers=config.steps_in_flight,  # no step's logits outlive the ring
    )
    if kernels.NAME != "triton" or device.type == "cuda":  # not Triton's CPU interpreter (tests)
        runner.warm_up(max_model_len, config.max_num_batched_tokens)
    device_thread = None
    if config.overlap_steps:
        device_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headrace-device")
    return Executor(runner, ParallelConfig(), device_thread=device_thread)
