"""The ranks of a tensor/pipeline-parallel worker: start, set up, supervise, stop.

Rank 0 is the worker process itself (it serves gRPC, schedules and samples, and runs its
own shard of stage 0). `RankGroup` spawns the other ranks of its node as child processes
and watches them: a rank that dies, or a step that fails on rank 0, ends the whole worker at
once (exit code 1, children killed), because the surviving ranks cannot go on with a shard
missing. Each child in turn exits as soon as its parent is gone, so no process outlives the
worker. On a worker of several nodes, each other node's process (`serving/follower.py`)
spawns and watches its own ranks the same way; the nodes watch each other through the
rendezvous (`rendezvous.py`).

Every rank meets rank 0 at its store and builds its shard with the same `build_shard`:
process groups, the model with only its layers and heads (reading only its slice of each
checkpoint tensor), and a KV cache sized so that every rank fits the same number of blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from headrace.kernels import select_kernels
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.distributed.pipeline import PendingSends, StageRunner, receive_plan
from headrace.worker.distributed.rank_control import RankCommandError, RankControl
from headrace.worker.distributed.rendezvous import COLLECTIVE_TIMEOUT, connect_store
from headrace.worker.distributed.step_plan import MirrorTable, StepPlan
from headrace.worker.execution.host_memory import keep_freed_memory
from headrace.worker.execution.kv_cache import kv_cache_blocks
from headrace.worker.execution.model_runner import ModelRunner
from headrace.worker.lora.manager import start_lora
from headrace.worker.models.registry import ModelWeights, load_model
from torch import nn

logger = logging.getLogger(__name__)

#: How often a child checks that rank 0 is still alive.
PARENT_POLL_S = 0.2
#: How long `close` waits for children to leave on their own before killing them.
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class RankSetup:
    """Everything a rank needs to build its shard; pickled to each child at spawn."""

    config: EngineConfig
    #: The weights (and how the linear layers hold them).
    source: ModelWeights
    dtype: torch.dtype
    max_model_len: int
    #: Rank 0's store for the rendezvous, as this node reaches it.
    store_host: str
    store_port: int
    #: Intra-op threads per rank on CPU (the node's cores shared among its ranks).
    num_threads: int
    log_level: int

    @classmethod
    def for_node(
        cls,
        config: EngineConfig,
        source: ModelWeights,
        dtype: torch.dtype,
        max_model_len: int,
        store_address: tuple[str, int],
    ) -> RankSetup:
        """The setup of this node's ranks (its cores shared among them)."""
        local_size = config.nodes.local_size(config.world_size)
        return cls(
            config=config,
            source=source,
            dtype=dtype,
            max_model_len=max_model_len,
            store_host=store_address[0],
            store_port=store_address[1],
            num_threads=max(1, torch.get_num_threads() // local_size),
            log_level=logging.getLogger().getEffectiveLevel(),
        )

    def on_this_node(
        self, source: ModelWeights, store_address: tuple[str, int], node_rank: int
    ) -> RankSetup:
        """Rank 0's setup as another node runs it: its own copy of the weights, its own cores,
        rank 0's store as it reaches it, and its node rank."""
        nodes = dataclasses.replace(self.config.nodes, node_rank=node_rank)
        here = RankSetup.for_node(
            dataclasses.replace(self.config, nodes=nodes),
            source,
            self.dtype,
            self.max_model_len,
            store_address,
        )
        return dataclasses.replace(here, log_level=self.log_level)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return self.config.nodes.local_ranks(self.world_size)

    def device(self, rank: int) -> torch.device:
        base = self.config.torch_device()
        if base.type != "cuda":
            return base
        local_rank = rank - self.local_ranks().start
        return torch.device("cuda", (base.index or 0) + local_rank)


@dataclass(slots=True)
class Shard:
    """One rank's part of the model, ready to run steps."""

    parallel: ParallelConfig
    runner: ModelRunner
    #: A gloo group over all ranks for host-side messages (step plans), also under NCCL.
    plan_group: Any


def build_shard(setup: RankSetup, rank: int, store: dist.Store) -> Shard:
    """Join the process group and build this rank's model shard and KV cache."""
    config = setup.config
    device = setup.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(setup.num_threads)
        keep_freed_memory()
    parallel, plan_group = _init_process_groups(setup, rank, store, device)
    kernels = select_kernels(config.kernel_backend, device)
    loaded = load_model(setup.source, setup.dtype, device, parallel, kernels)
    lora = start_lora(cast(nn.Module, loaded.model), kernels, config)  # before sizing the cache
    local_blocks = kv_cache_blocks(config, loaded.model, device, setup.dtype, setup.max_model_len)
    # Every rank holds the same block ids, so the pool is what the tightest rank fits.
    agreed = torch.tensor([local_blocks])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=plan_group)
    num_blocks = int(agreed.item())
    runner = ModelRunner(
        loaded.model,
        device,
        setup.dtype,
        config.block_size,
        num_blocks,
        parallel,
        lora=lora,
        kv_cache_dtype=config.kv_cache_torch_dtype(setup.dtype),
    )
    if device.type == "cuda":
        runner.warm_up_kernels(setup.max_model_len)
    logger.info(
        "rank %d ready: stage %d layers %s, tp rank %d, kv heads %d, %d KV blocks (this rank %d)",
        rank,
        parallel.pipeline_parallel_rank,
        parallel.stage_layers(int(loaded.hf_config.num_hidden_layers)),
        parallel.tensor_parallel_rank,
        loaded.model.num_kv_heads,
        num_blocks,
        local_blocks,
    )
    return Shard(parallel, runner, plan_group)


def _init_process_groups(
    setup: RankSetup, rank: int, store: dist.Store, device: torch.device
) -> tuple[ParallelConfig, Any]:
    config = setup.config
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=setup.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    # Every rank creates every group, in the same order (torch.distributed requires it).
    stage_groups = [
        dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        for stage in range(pp_size)
    ]
    plan_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    group = stage_groups[rank // tp_size] if pp_size > 1 else None
    expert_parallel = config.enable_expert_parallel
    parallel = ParallelConfig.for_rank(rank, tp_size, pp_size, group, expert_parallel)
    return parallel, plan_group


class RankGroup:
    """This node's ranks other than the one running in this process, as supervised child
    processes (on node 0 every local rank but rank 0; on other nodes all of theirs)."""

    def __init__(self, setup: RankSetup, ranks: Sequence[int]) -> None:
        self.setup = setup
        #: Rank 0 shares the cores with the children while the group lives (see build_shard).
        self._driver_threads = torch.get_num_threads()
        #: Called (from a supervisor thread) before a failing worker exits, e.g. to mark
        #: health NOT_SERVING.
        self.on_failure: list[Callable[[str], None]] = []
        self._closing = False
        # `python -m`, not multiprocessing's spawn: a child must not re-run the caller's
        # __main__ (a user's script without a main guard would start ranks recursively).
        self.processes = [self._spawn(rank) for rank in ranks]
        for rank, process in zip(ranks, self.processes, strict=True):
            threading.Thread(
                target=self._supervise,
                args=(rank, process),
                name=f"headrace-rank-{rank}-supervisor",
                daemon=True,
            ).start()

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "headrace.worker.distributed.ranks", str(rank)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(self.setup))
        process.stdin.close()
        return process

    def _supervise(self, rank: int, process: subprocess.Popen[bytes]) -> None:
        code = process.wait()
        # A rank exits 0 only on rank 0's stop plan; anything else is a rank lost.
        if code != 0 and not self._closing:
            self.fail(f"rank {rank} exited unexpectedly (exit code {code})")

    def wait(self, timeout_s: float | None = None) -> bool:
        """Until every rank has exited (another node's ranks leave on rank 0's stop plan), or
        ``timeout_s`` has passed; whether they all have."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for process in self.processes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                process.wait(left)
            except subprocess.TimeoutExpired:
                return False
        return True

    def fail(self, reason: str) -> NoReturn:
        """End the worker: the ranks cannot continue with one missing or out of step."""
        logger.critical("worker failed: %s; stopping every rank", reason)
        for callback in self.on_failure:
            try:
                callback(reason)
            except Exception:
                logger.exception("failure callback raised")
        self._kill_children()
        logging.shutdown()
        os._exit(1)

    def close(self) -> None:
        """After rank 0 has broadcast the stop plan: wait for the children, then reap them."""
        self._closing = True
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        self._kill_children()
        torch.set_num_threads(self._driver_threads)

    def abort(self) -> None:
        """Rank 0 failed to start: kill the children and leave the process group, if joined."""
        self._closing = True
        self._kill_children()
        torch.set_num_threads(self._driver_threads)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_children(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(1.0)


def rank_main(setup: RankSetup, rank: int) -> None:
    """A child rank: build the shard, then run every step rank 0 broadcasts until stopped."""
    logging.basicConfig(
        level=setup.log_level,
        format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s",
    )
    _exit_with_parent()
    try:
        store = connect_store(setup.store_host, setup.store_port, setup.world_size)
        shard = build_shard(setup, rank, store)
        _serve_steps(shard)
        dist.destroy_process_group()
    except BaseException:
        logger.exception("rank %d failed", rank)
        logging.shutdown()
        os._exit(1)


def _serve_steps(shard: Shard) -> None:
    """Run each step rank 0 sends, and each control command, until told to stop."""
    mirrors = MirrorTable()
    stage = StageRunner(shard.runner, shard.parallel)
    sends = PendingSends(shard.parallel)
    control = RankControl(shard.runner, shard.parallel, shard.plan_group)
    while (message := receive_plan(shard.parallel, shard.plan_group)) is not None:
        if not isinstance(message, StepPlan):
            with contextlib.suppress(RankCommandError):  # rank 0 reports it
                control.run_everywhere(message)
            continue
        mirrors.apply(message)
        shard.runner.copy_blocks(message.block_copies)
        inputs = [shard.runner.build_inputs(mirrors.chunks(mb)) for mb in message.micro_batches]
        stage.run(inputs, [mb.logit_rows for mb in message.micro_batches], sends)
        sends.wait()
    control.close()


def _exit_with_parent() -> None:
    """Leave at once when rank 0's process is gone (killed, crashed), whatever we are doing."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="headrace-parent-watch", daemon=True).start()


if __name__ == "__main__":  # a child rank, started by RankGroup._spawn
    # Run the importable module's copy, so its classes are the ones the pickle names.
    from headrace.worker.distributed import ranks

    ranks.rank_main(pickle.load(sys.stdin.buffer), int(sys.argv[1]))
