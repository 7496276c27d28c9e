"""Where a worker's ranks run: one node, or several that meet at a rendezvous address.

A worker of ``world_size`` ranks (tensor x pipeline) may span ``nnodes`` nodes of
``ranks_per_node`` ranks each. Node ``r`` runs the consecutive global ranks
``r * ranks_per_node ...``; since rank = stage x tensor_parallel_size + tensor rank, a node
that holds a whole number of tensor-parallel groups keeps every all-reduce inside itself and
only the pipeline's activations cross between nodes (the default placement, as in vLLM and
SGLang). Other placements the sizes allow are accepted and their cost logged.

Node 0 runs rank 0 (gRPC, scheduler, sampler) and hosts the rendezvous (a TCPStore) on
``dist_init_addr``'s port; other nodes run only their ranks (`worker/serving/follower.py`).
The flag names follow SGLang (``--nnodes``, ``--node-rank``, ``--dist-init-addr``): one
address flag maps directly onto a LeaderWorkerSet's ``$(LWS_LEADER_ADDRESS):PORT``.
"""

from __future__ import annotations

from dataclasses import dataclass

from headrace.sdk.errors import InvalidArgumentError

#: How long a node may go unheard (its heartbeat) before the worker ends.
DEFAULT_NODE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class NodeConfig:
    #: Nodes the worker's ranks run on (1: every rank on this machine).
    nnodes: int = 1
    #: This node's index: 0 serves gRPC and runs rank 0; others run only their ranks.
    node_rank: int = 0
    #: "HOST:PORT" where node 0 hosts the rendezvous (all nodes give the same address);
    #: needed when nnodes > 1.
    dist_init_addr: str | None = None
    #: Ranks on each node; None splits the worker's ranks evenly over the nodes.
    ranks_per_node: int | None = None
    #: Seconds a node may go unheard (heartbeats through the rendezvous) before the worker
    #: ends, so a dead or cut-off node stops it in seconds, not at the collective timeout.
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise InvalidArgumentError("nnodes", f"must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidArgumentError(
                "node_rank", f"must be in [0, nnodes = {self.nnodes}), got {self.node_rank}"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise InvalidArgumentError("dist_init_addr", "is needed when nnodes > 1 (HOST:PORT)")
        if self.dist_init_addr is not None:
            self.rendezvous()  # checks the form
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise InvalidArgumentError("ranks_per_node", f"must be >= 1, got {self.ranks_per_node}")
        if self.node_timeout_s <= 0:
            raise InvalidArgumentError("node_timeout_s", f"must be > 0, got {self.node_timeout_s}")

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    def rendezvous(self) -> tuple[str, int]:
        """(host, port) of ``dist_init_addr``; an IPv6 host may be bracketed ("[::1]:29500")."""
        host, sep, port = (self.dist_init_addr or "").rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(
                "dist_init_addr", f"must be HOST:PORT, got {self.dist_init_addr!r}"
            )
        return host, int(port)

    def local_size(self, world_size: int) -> int:
        """Ranks on each node; the sizes must fill every node exactly."""
        local = self.ranks_per_node or max(1, world_size // self.nnodes)
        if local * self.nnodes != world_size:
            raise InvalidArgumentError(
                "ranks_per_node",
                f"{local} ranks on each of {self.nnodes} nodes is not the worker's "
                f"{world_size} ranks (tensor x pipeline parallel size)",
            )
        return local

    def local_ranks(self, world_size: int) -> range:
        """The global ranks this node runs."""
        local = self.local_size(world_size)
        return range(self.node_rank * local, (self.node_rank + 1) * local)

    def placement(self, tensor_parallel_size: int, world_size: int) -> str:
        """A line saying where the ranks run and what crosses between nodes."""
        local = self.local_size(world_size)
        nodes = f"{world_size} ranks on {self.nnodes} nodes of {local}"
        if self.nnodes == 1:
            return nodes
        if local % tensor_parallel_size == 0:
            return f"{nodes}: tensor parallel inside each node, pipeline stages across nodes"
        return (
            f"{nodes}: tensor-parallel groups of {tensor_parallel_size} span nodes, so every "
            "layer's all-reduce crosses the network (slower than keeping each group on a node)"
        )
