"""Another node of a worker whose ranks span nodes: ``headrace worker --node-rank R`` (R > 0).

It serves no requests: node 0 does (gRPC, scheduler, sampler). It reads its own copy of the
model (same checkpoint, any path), meets rank 0 at ``--dist-init-addr`` (waiting for it if it
is not up yet), is admitted there or refused with the mismatch named (`rendezvous.py`), then
spawns and watches its ranks, which take every step from rank 0. Probes get `grpc.health.v1`
alone on ``--health-port``: NOT_SERVING until every rank of the worker is up, then SERVING.

It ends with its ranks: exit 0 when rank 0's stop plan ends them; 1 when one of them dies or
rank 0 is lost (unheard for ``--node-timeout`` seconds), its ranks killed first, which in
turn ends rank 0's worker the same way. SIGTERM is logged and otherwise left to rank 0: its
ranks leave when rank 0 stops the worker, so a group torn down together drains at node 0
instead of failing there because a node left first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import torch.distributed as dist
from headrace.sdk import serving
from headrace.sdk.errors import UnavailableError
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.ranks import RankGroup
from headrace.worker.distributed.rendezvous import (
    COLLECTIVE_TIMEOUT,
    NodeIdentity,
    NodeWatch,
    connect_store,
    join,
)
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.models.registry import ModelWeights

logger = logging.getLogger(__name__)

#: How often health is updated from the rendezvous's "ready".
READY_POLL_S = 0.2


def run_follower(config: EngineConfig, host: str, health_port: int | None) -> int:
    """Join rank 0, run this node's ranks until they end; the exit code (0: rank 0 stopped
    them). A refused node raises `NodeRefusedError` naming the mismatch."""
    nodes = config.nodes
    address = nodes.rendezvous()
    spec = ModelSpec.load(config)
    source = ModelWeights(spec.path, spec.quantization, spec.gguf_file, config.int8_activations)
    store = _reach(address, config.world_size)
    ranks: RankGroup | None = None

    def lost(reason: str) -> None:  # the heartbeat starts before admission, the ranks after
        if ranks is not None:
            # Rank 0's store goes with it when it stops, maybe before this node saw its
            # "stopping": ranks that then leave on their own were stopped, not orphaned.
            if ranks.wait(nodes.node_timeout_s):
                return
            ranks.fail(reason)
        logger.critical("node %d: %s", nodes.node_rank, reason)
        os._exit(1)

    watch = NodeWatch(address, nodes.node_rank, nodes, lost)
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    identity = NodeIdentity.of(config.model, source, tp, pp, nodes)
    setup = join(store, nodes.node_rank, identity).on_this_node(source, address, nodes.node_rank)
    local = setup.local_ranks()
    ranks = RankGroup(setup, local)
    watch.watch(0)
    print(
        f"headrace worker node {nodes.node_rank} of {nodes.nnodes}: ranks "
        f"{local.start}-{local.stop - 1} of {config.model}, rank 0 at {address[0]}:{address[1]}",
        flush=True,
    )
    asyncio.run(_serve_health(ranks, watch, host, health_port))
    watch.close()
    print("headrace worker node stopped", file=sys.stderr, flush=True)
    return 0


def _reach(address: tuple[str, int], world_size: int) -> dist.TCPStore:
    """Rank 0's store, waiting (retrying) while rank 0 is not up yet."""
    logger.info("meeting rank 0 at %s:%d", *address)
    try:
        return connect_store(*address, world_size)
    except dist.DistError as exc:
        raise UnavailableError(
            f"node 0's rendezvous at {address[0]}:{address[1]} did not answer within "
            f"{COLLECTIVE_TIMEOUT}: {str(exc).splitlines()[0]}"
        ) from None


async def _serve_health(
    ranks: RankGroup, watch: NodeWatch, host: str, health_port: int | None
) -> None:
    """Health for probes while the ranks run; returns when they have all left."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGTERM, logger.info, "SIGTERM: this node's ranks leave when rank 0 stops them"
    )
    health = serving.Server([], max_message_mib=1)
    if health_port is not None:
        await health.serve_health(host, health_port)
        await health.set_serving(False)
    ranks_done = asyncio.ensure_future(asyncio.to_thread(ranks.wait))
    serving_now = False
    while not ranks_done.done():
        if watch.ready.is_set() and not serving_now:
            serving_now = True
            await health.set_serving(True)
        await asyncio.wait([ranks_done], timeout=READY_POLL_S)
    await health.set_serving(False)
    await health.stop(0)
