"""Runs scheduled steps on one process, or hands over to the ranks of a parallel worker.

`start_executor` is the one place the engine's model is built, and picks the `Executor`
(`interface`) that runs it. With several ranks, `distributed.executor` starts the other ranks
and its `DistributedExecutor` runs each step across them. With one, the model loads here and:

- `UniprocExecutor` runs a step when it is submitted, on the engine's thread;
- `OverlappedExecutor` (`EngineConfig.overlap_steps`) builds the step's batch at submission
  (it reads what the engine changes next) and runs its device work (forward, LM head) on a
  device thread, while the engine goes on with the host's work of other steps.

Both hand back the step's result as a future (ready, or on its way), and run control commands
on their one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from headrace.kernels import KernelSet
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.executor import start_distributed
from headrace.worker.distributed.rank_control import RankCommand, RankControl
from headrace.worker.execution.batch import PreparedBatch, StepResult
from headrace.worker.execution.cpu_threads import (
    ThreadGovernor,
    bind_process,
    parse_cpu_list,
    start_governor,
)
from headrace.worker.execution.host_memory import keep_freed_memory
from headrace.worker.execution.interface import Executor, InFlightStep
from headrace.worker.execution.kv_cache import kv_cache_blocks
from headrace.worker.execution.model_runner import ModelRunner
from headrace.worker.lora.manager import start_lora
from headrace.worker.models.registry import ModelWeights, load_model
from headrace.worker.scheduling.output import SchedulerOutput
from torch import nn


class UniprocExecutor(Executor):
    """One rank, one thread: a step runs when it is submitted."""

    def __init__(self, runner: ModelRunner, threads: ThreadGovernor | None = None) -> None:
        self.runner = runner
        #: The only rank's side of control commands.
        self.rank_control = RankControl(runner, runner.parallel, None)
        #: On a CPU: the thread count, applied on each thread before it computes.
        self.threads = threads

    def submit(self, step: SchedulerOutput) -> InFlightStep[Any]:
        with self._computing(step.num_batched_tokens):
            return InFlightStep(step, self.runner.execute(step))  # (pending: the result)

    def collect(self, in_flight: InFlightStep[Any]) -> StepResult:
        # (the engine samples next on this thread, which ran the step at the governor's count)
        return cast(StepResult, in_flight.pending)

    def _apply_threads(self) -> None:
        if self.threads is not None:
            self.threads.apply()

    def _computing(self, num_tokens: int) -> AbstractContextManager[None]:
        """A step's compute on this thread: at the governor's count, timed for it."""
        return nullcontext() if self.threads is None else self.threads.step(num_tokens)

    def control(self, command: RankCommand) -> None:
        self.rank_control.run_everywhere(command)

    def close(self) -> None:
        self.rank_control.close()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Keeps nothing: one rank has no fault that ends the process (a fault in a step
        fails that step's requests only), so ``callback`` is never called."""


class OverlappedExecutor(UniprocExecutor):
    """One rank, whose steps' device work runs in order on a device thread."""

    def __init__(self, runner: ModelRunner, threads: ThreadGovernor | None = None) -> None:
        super().__init__(runner, threads)
        #: Runs the submitted steps' device work one after another; None once closed.
        self.device_thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="headrace-device"
        )

    def submit(self, step: SchedulerOutput) -> InFlightStep[Future[StepResult]]:
        assert self.device_thread is not None, "the executor is closed"
        batch = self.runner.prepare(step.chunks)  # now: it reads what the engine changes
        running = self.device_thread.submit(self._run, step, batch)
        return InFlightStep(step, running)

    def collect(self, in_flight: InFlightStep[Any]) -> StepResult:
        self._apply_threads()  # the engine samples on this thread next
        return cast(Future[StepResult], in_flight.pending).result()

    def _run(self, step: SchedulerOutput, batch: PreparedBatch) -> StepResult:
        with self._computing(step.num_batched_tokens):
            return self.runner.run(step.block_copies, batch)

    def close(self) -> None:
        if self.device_thread is not None:
            self.device_thread.shutdown()
            self.device_thread = None
        super().close()


def start_executor(
    config: EngineConfig,
    source: ModelWeights,
    dtype: torch.dtype,
    device: torch.device,
    kernels: KernelSet,
    max_model_len: int,
    hf_config: Any,
) -> Executor:
    if device.type == "cpu" and config.cpu_bind:
        bind_process(parse_cpu_list(config.cpu_bind))  # before any rank or thread starts
    if config.world_size > 1:
        return start_distributed(config, source, dtype, device, max_model_len, hf_config)
    threads = None
    if device.type == "cpu":
        keep_freed_memory()
        threads = start_governor(config.cpu_threads)
        threads.apply()  # loading and warming up compute on this thread
    loaded = load_model(source, dtype, device, kernels=kernels)
    if threads is not None:
        loaded.model.watch_layers(threads.between_layers)
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
        kv_cache_dtype=config.kv_cache_torch_dtype(dtype),
    )
    if kernels.NAME != "triton" or device.type == "cuda":  # not Triton's CPU interpreter (tests)
        runner.warm_up(max_model_len, config.max_num_batched_tokens)
    if config.overlap_steps:
        return OverlappedExecutor(runner, threads)
    return UniprocExecutor(runner, threads)
