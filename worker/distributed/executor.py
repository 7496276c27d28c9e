"""Rank 0's side of a tensor/pipeline-parallel worker: start the ranks, then run each step
across them.

`start_distributed` first checks that the model splits as asked (before any process starts,
so a bad size is one clear error), then hosts the rendezvous, starts the other ranks of its
node (and, with several nodes, admits and watches the other nodes, which start theirs), and
builds rank 0's own shard.
`DistributedExecutor` (an `Executor`, see `execution.interface`) sends each step's plan to
every rank, runs rank 0's stage, and later collects the logits the last stage sends back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.pipeline import (
    DRIVER_RANK,
    PendingSends,
    StageRunner,
    send_plan,
    split_micro_batches,
)
from headrace.worker.distributed.rank_control import RankCommand, RankControl, for_other_ranks
from headrace.worker.distributed.ranks import RankGroup, RankSetup, Shard, build_shard
from headrace.worker.distributed.rendezvous import NodeIdentity, OtherNodes, host_store
from headrace.worker.distributed.step_plan import PlanEncoder
from headrace.worker.execution.batch import PreparedBatch, StepResult, merge_results
from headrace.worker.execution.interface import Executor, InFlightStep
from headrace.worker.models.config import ModelConfig
from headrace.worker.models.registry import ModelWeights
from headrace.worker.scheduling.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingStep:
    """Rank 0's part of a step submitted to the ranks, whose logits are not collected yet."""

    batches: list[PreparedBatch]
    #: The logits, when rank 0 computed them itself (one stage); else they are still coming.
    logits: list[torch.Tensor | None] | None
    #: Rank 0's sends of this step (plan, activations), waited for at collection.
    sends: PendingSends


def start_distributed(
    config: EngineConfig,
    source: ModelWeights,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    hf_config: Any,
) -> DistributedExecutor:
    """Check the split, host the rendezvous, start the other ranks, build rank 0's shard."""
    check_model_splits(config, hf_config, device)
    nodes = config.nodes
    logger.info("placement: %s", nodes.placement(config.tensor_parallel_size, config.world_size))
    store = host_store(nodes, config.world_size)
    setup = RankSetup.for_node(config, source, dtype, max_model_len, ("127.0.0.1", store.port))
    ranks = RankGroup(setup, setup.local_ranks()[1:])
    others = None
    if nodes.is_multi_node:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        identity = NodeIdentity.of(config.model, source, tp, pp, nodes)
        others = OtherNodes(store, identity, setup, nodes, ranks.fail)
    try:
        shard = build_shard(setup, DRIVER_RANK, store)
    except BaseException:
        ranks.abort()
        raise
    if others is not None:
        others.ready()
    return DistributedExecutor(shard, ranks, config.pipeline_micro_batches, store, others)


def check_model_splits(config: EngineConfig, hf_config: Any, device: torch.device) -> None:
    """Refuse sizes the model cannot be split by, naming the flag and the model's numbers."""
    model = ModelConfig.from_hf(hf_config)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    problems = []
    if model.num_heads % tp:
        problems.append(f"num_attention_heads ({model.num_heads}) is not divisible by it")
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(
            f"num_key_value_heads ({model.num_kv_heads}) neither divides it nor is divisible by it"
        )
    if model.intermediate_size % tp:
        problems.append(f"intermediate_size ({model.intermediate_size}) is not divisible by it")
    if problems:
        raise InvalidArgumentError("tensor_parallel_size", f"{tp}: " + "; ".join(problems))
    if config.enable_expert_parallel and (model.moe is None or model.moe.num_experts % tp):
        experts = "no experts" if model.moe is None else f"{model.moe.num_experts} experts"
        raise InvalidArgumentError(
            "enable_expert_parallel",
            f"the model has {experts}, which tensor_parallel_size {tp} cannot share out evenly",
        )
    if pp > model.num_layers:
        raise InvalidArgumentError(
            "pipeline_parallel_size",
            f"{pp} exceeds the model's {model.num_layers} layers (each stage needs one)",
        )
    local_size = config.nodes.local_size(config.world_size)
    if device.type == "cuda":
        first = device.index or 0
        available = torch.cuda.device_count() - first
        if local_size > available:
            raise InvalidArgumentError(
                "tensor_parallel_size",
                f"{tp} x pipeline_parallel_size {pp} needs {local_size} GPUs on this node "
                f"from cuda:{first}; {available} are visible",
            )


class DistributedExecutor(Executor):
    """Rank 0's side of a step: plan, send, run stage 0, collect the logits."""

    def __init__(
        self,
        shard: Shard,
        ranks: RankGroup,
        num_micro_batches: int,
        store: dist.TCPStore,
        others: OtherNodes | None = None,
    ) -> None:
        self.shard = shard
        self.runner = shard.runner
        self.ranks = ranks
        #: The rendezvous rank 0 hosts; it lives as long as the ranks.
        self.store = store
        #: The worker's other nodes, when its ranks span several.
        self.others = others
        self.num_micro_batches = num_micro_batches
        self.encoder = PlanEncoder()
        self.stage = StageRunner(shard.runner, shard.parallel)
        #: Rank 0's own side of control commands (the other ranks run theirs in `ranks`).
        self.rank_control = RankControl(shard.runner, shard.parallel, shard.plan_group)

    def submit(self, step: SchedulerOutput) -> InFlightStep[PendingStep]:
        """Send the plan and run rank 0's stage; later stages run on while rank 0 goes on."""
        chunks = step.chunks
        parts = split_micro_batches([c.num_new_tokens for c in chunks], self.num_micro_batches)
        micro_batches = [chunks[part.start : part.stop] for part in parts]
        batches = [self.shard.runner.prepare(mb) for mb in micro_batches]
        rows = [batch.logit_rows for batch in batches]
        sends = PendingSends(self.shard.parallel)
        try:
            plan = self.encoder.encode(micro_batches, rows, step.block_copies)
            send_plan(plan, sends, self.shard.plan_group)
            self.shard.runner.copy_blocks(step.block_copies)
            logits = self.stage.run([batch.inputs for batch in batches], rows, sends)
        except Exception as exc:  # the ranks are out of step now; nothing can be retried
            self.ranks.fail(f"step failed on rank 0: {exc!r}")
        return InFlightStep(step, PendingStep(batches, logits, sends))

    def collect(self, in_flight: InFlightStep[PendingStep]) -> StepResult:
        pending = in_flight.pending
        batches, logits = pending.batches, pending.logits
        try:
            if logits is None:
                logits = self.stage.receive_logits([batch.logit_rows for batch in batches])
            pending.sends.wait()
        except Exception as exc:
            self.ranks.fail(f"step failed on rank 0: {exc!r}")
        return merge_results([b.result(lg) for b, lg in zip(batches, logits, strict=True)])

    def control(self, command: RankCommand) -> None:
        """Send the command to the other ranks, then run it here and learn their outcomes."""
        sends = PendingSends(self.shard.parallel)
        try:
            send_plan(for_other_ranks(command), sends, self.shard.plan_group)
        except Exception as exc:  # the ranks are out of step now; nothing can be retried
            self.ranks.fail(f"sending a command failed on rank 0: {exc!r}")
        try:
            self.rank_control.run_everywhere(command)
        finally:
            sends.wait()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self.ranks.on_failure.append(callback)

    def close(self) -> None:
        """Leave any weights group, tell every rank to stop, wait for them, and leave the
        process group."""
        self.rank_control.close()
        if self.others is not None:
            self.others.stop()
        try:
            sends = PendingSends(self.shard.parallel)
            send_plan(None, sends, self.shard.plan_group)
            sends.wait()
        finally:
            self.ranks.close()
            dist.destroy_process_group()
