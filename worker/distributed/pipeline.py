"""One step's forward pass on one rank of a tensor/pipeline-parallel worker.

Design note. Two things keep pipeline stages busy. (1) Steps in flight: the engine submits
one step per stage before collecting the oldest, each over different sequences, so stage 0
runs step k + 1 while stage 1 runs step k (rank 0 never waits on a later stage to send a
plan: plans and activations go point-to-point without blocking). (2) Micro-batches: a step
is also cut into micro-batches (by sequence, decodes first in each) that flow through the
stages in order, so within a step stage s runs micro-batch m while stage s + 1 runs m - 1.

Every rank of a stage holds the whole (hidden, residual) pair after the row-parallel
all-reduce, so rank r of stage s sends to rank r of stage s + 1 and no gather is needed. The
last stage computes logits for the rows the plan names (the vocab-parallel head all-gathers
them), and its tensor-parallel rank 0 sends them to rank 0, which samples: the sampler, its
seeded generators and the stop checks stay in one place, exactly as at TP=1.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import torch
import torch.distributed as dist
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.distributed.rank_control import RankCommand
from headrace.worker.distributed.step_plan import StepPlan
from headrace.worker.execution.batch import ModelInputs
from headrace.worker.execution.model_runner import ModelRunner

#: Global rank of the process that schedules, samples and serves.
DRIVER_RANK = 0
#: Point-to-point message kinds, so a receive never matches another kind's send.
PLAN_TAG, ACTIVATION_TAG, LOGITS_TAG = 1, 2, 3


def split_micro_batches(num_tokens: list[int], num_micro_batches: int) -> list[range]:
    """Cut consecutive chunks into at most ``num_micro_batches`` runs of similar token counts.

    Returns index ranges over the chunks. A chunk is never split, so there are fewer
    micro-batches than asked when there are fewer chunks (or one chunk dominates).
    """
    total = sum(num_tokens)
    bounds = [0]
    running = 0  # tokens before chunk i
    for i, count in enumerate(num_tokens):
        target = total * len(bounds) / num_micro_batches  # where the next cut belongs
        overshoot, shortfall = running + count - target, target - running
        if len(bounds) < num_micro_batches and i > bounds[-1] and 0 < overshoot >= shortfall:
            bounds.append(i)  # cutting before chunk i lands nearer the target than after it
        running += count
    bounds.append(len(num_tokens))
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]


class PendingSends:
    """Non-blocking sends in flight, each with its buffer (which must live until it is sent)."""

    def __init__(self, parallel: ParallelConfig) -> None:
        self.parallel = parallel
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, dst: int, tag: int, group: Any = None) -> None:
        buffer = tensor.contiguous()
        with self.parallel.comm_timer:
            work = dist.isend(buffer, dst, group=group, tag=tag)
        assert work is not None
        self._sends.append((work, buffer))

    def wait(self) -> None:
        with self.parallel.comm_timer:
            for work, _ in self._sends:
                work.wait()
        self._sends.clear()


#: What rank 0 sends the other ranks: a step's plan, a control command, or None (stop).
RankMessage = StepPlan | RankCommand | None


def send_plan(plan: RankMessage, sends: PendingSends, group: Any) -> None:
    """Rank 0 sends a step's plan (or a control command; None: stop) to every other rank,
    without waiting for them.

    Point-to-point rather than a broadcast, which would hold rank 0 until the slowest rank
    (a later pipeline stage still busy with an earlier step) joined it.
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    for rank in range(1, sends.parallel.world_size):
        sends.send(size, rank, PLAN_TAG, group)
        sends.send(payload, rank, PLAN_TAG, group)


def receive_plan(parallel: ParallelConfig, group: Any) -> RankMessage:
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, DRIVER_RANK, group=group, tag=PLAN_TAG)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, DRIVER_RANK, group=group, tag=PLAN_TAG)
    message: RankMessage = pickle.loads(payload.numpy().tobytes())
    return message


class StageRunner:
    """Runs this rank's stage of each micro-batch and moves activations between stages."""

    def __init__(self, runner: ModelRunner, parallel: ParallelConfig) -> None:
        self.runner = runner
        self.parallel = parallel

    @torch.inference_mode()
    def run(
        self, micro_batches: list[ModelInputs], logit_rows: list[list[int]], sends: PendingSends
    ) -> list[torch.Tensor | None] | None:
        """Run every micro-batch through this stage, queueing its sends on ``sends``.

        Returns the logits of each micro-batch where this is rank 0 on the last stage;
        elsewhere None (rank 0 with later stages collects them with `receive_logits`).
        """
        parallel = self.parallel
        logits: list[torch.Tensor | None] = []
        for inputs, rows in zip(micro_batches, logit_rows, strict=True):
            carry = None if parallel.is_first_stage else self._receive_carry(inputs)
            hidden = self.runner.forward(inputs, carry)
            if not parallel.is_last_stage:
                next_rank = parallel.stage_rank(parallel.pipeline_parallel_rank + 1)
                sends.send(hidden, next_rank, ACTIVATION_TAG)
                continue
            step_logits = self.runner.compute_logits(hidden, rows)
            if parallel.rank == DRIVER_RANK:
                logits.append(step_logits)
            elif parallel.tensor_parallel_rank == 0 and step_logits is not None:
                sends.send(step_logits, DRIVER_RANK, LOGITS_TAG)
        return logits if parallel.rank == DRIVER_RANK and parallel.is_last_stage else None

    def receive_logits(self, logit_rows: list[list[int]]) -> list[torch.Tensor | None]:
        """Rank 0: each micro-batch's logits from the last stage's first rank, in order."""
        return [self._receive_logits(len(rows)) for rows in logit_rows]

    def _receive_carry(self, inputs: ModelInputs) -> torch.Tensor:
        hidden_size = self.runner.model.hidden_size
        carry = torch.empty(
            (2, inputs.num_tokens, hidden_size), dtype=self.runner.dtype, device=self.runner.device
        )
        src = self.parallel.stage_rank(self.parallel.pipeline_parallel_rank - 1)
        with self.parallel.comm_timer:
            dist.recv(carry, src, tag=ACTIVATION_TAG)
        return carry

    def _receive_logits(self, num_rows: int) -> torch.Tensor | None:
        if num_rows == 0:
            return None
        shape = (num_rows, self.runner.model.vocab_size)
        logits = torch.empty(shape, dtype=torch.float32, device=self.runner.device)
        last_stage = self.parallel.pipeline_parallel_size - 1
        with self.parallel.comm_timer:
            dist.recv(logits, last_stage * self.parallel.tensor_parallel_size, tag=LOGITS_TAG)
        return logits
