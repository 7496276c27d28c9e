"""A worker's ranks over several nodes: the placement, the admission of other nodes at the
rendezvous, and the heartbeats that end the worker when a node is lost (in one process, over
a real TCPStore; tests/e2e/test_multinode.py starts real nodes)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.nodes import NodeConfig
from headrace.worker.distributed.rendezvous import (
    NodeIdentity,
    NodeRefusedError,
    NodeWatch,
    OtherNodes,
    connect_store,
    host_store,
    join,
)
from headrace.worker.models.registry import ModelWeights

from tests.factories import cached_checkpoint
from tests.worker.test_parallel_weights import free_port


def two_nodes() -> NodeConfig:
    """Two nodes meeting at a free loopback port (each test its own store)."""
    return NodeConfig(nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}", node_timeout_s=0.5)


@pytest.mark.parametrize(
    ("fields", "flag", "words"),
    [
        ({"nnodes": 0}, "nnodes", "must be >= 1"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank", "[0, nnodes = 2)"),
        ({"nnodes": 2}, "dist_init_addr", "needed when nnodes > 1"),
        ({"nnodes": 2, "dist_init_addr": "leader"}, "dist_init_addr", "HOST:PORT"),
        ({"nnodes": 2, "dist_init_addr": "leader:99999"}, "dist_init_addr", "HOST:PORT"),
        ({"ranks_per_node": 0}, "ranks_per_node", "must be >= 1"),
        ({"node_timeout_s": 0}, "node_timeout_s", "must be > 0"),
    ],
)
def test_bad_node_flags_name_the_flag(fields: dict[str, object], flag: str, words: str) -> None:
    with pytest.raises(InvalidArgumentError) as error:
        NodeConfig(**fields)  # type: ignore[arg-type]
    assert error.value.field == flag
    assert words in str(error.value)


def test_ranks_that_do_not_fill_the_nodes_are_refused_by_the_engine_config() -> None:
    nodes = NodeConfig(nnodes=2, dist_init_addr="leader:29500", ranks_per_node=3)
    with pytest.raises(InvalidArgumentError, match="3 ranks on each of 2 nodes is not the"):
        EngineConfig(model="m", tensor_parallel_size=2, pipeline_parallel_size=2, nodes=nodes)


def test_each_node_runs_consecutive_ranks_and_the_placement_is_said() -> None:
    node1 = NodeConfig(nnodes=2, node_rank=1, dist_init_addr="[::1]:29500")
    assert node1.rendezvous() == ("::1", 29500)
    assert node1.local_ranks(4) == range(2, 4)
    assert "tensor parallel inside each node" in node1.placement(2, 4)
    # TP=4 over two nodes of two: every all-reduce crosses between them, and the log says so.
    assert "span nodes" in node1.placement(4, 4)
    assert NodeConfig().local_ranks(4) == range(4)


def identity(path: Path, tp: int = 2, pp: int = 2) -> NodeIdentity:
    return NodeIdentity.of(str(path), ModelWeights(path), tp, pp, two_nodes())


def test_identity_mismatches_name_each_difference_but_not_the_path() -> None:
    model = cached_checkpoint("llama")
    other = cached_checkpoint("llama", num_layers=3)
    leader = identity(model)
    assert leader.mismatches(dataclasses.replace(leader, model="/elsewhere/same")) == []
    problems = leader.mismatches(identity(other, tp=1, pp=4))
    assert [p.split(":")[0] for p in problems] == [
        "model_digest",
        "tensor_parallel_size",
        "pipeline_parallel_size",
    ]
    assert f"node 0 has {model} " in problems[0] and f"this node {other} " in problems[0]
    version = leader.mismatches(dataclasses.replace(leader, version="0.0.1"))
    assert version == [f"version: node 0 has {leader.version}, this node 0.0.1"]


def test_a_node_is_admitted_with_rank_zeros_setup_or_refused_with_the_mismatch() -> None:
    model = cached_checkpoint("llama")
    nodes = two_nodes()
    store = host_store(nodes, 4)
    lost: list[str] = []
    others = OtherNodes(store, identity(model), {"the": "setup"}, nodes, lost.append)
    try:
        client = connect_store("127.0.0.1", store.port, 4)
        wrong = identity(cached_checkpoint("llama", num_layers=3))
        with pytest.raises(NodeRefusedError, match="node 1 refused: model_digest: node 0 has"):
            join(client, 1, wrong)
        # Refused, rank 0 still waits: the node started again with the right model joins.
        assert join(client, 1, identity(model)) == {"the": "setup"}
    finally:
        others.stop()


def test_a_node_that_stops_beating_is_lost_within_the_timeout() -> None:
    nodes = two_nodes()
    store = host_store(nodes, 4)
    address = ("127.0.0.1", store.port)
    lost = threading.Event()
    reasons: list[str] = []

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    leader = NodeWatch(address, 0, nodes, on_lost)
    follower = NodeWatch(address, 1, nodes, on_lost)
    leader.watch(1)
    time.sleep(3 * nodes.node_timeout_s)
    assert not lost.is_set()  # beating: never lost
    follower.close()
    stopped = time.monotonic()
    assert lost.wait(5 * nodes.node_timeout_s)
    assert time.monotonic() - stopped < 3 * nodes.node_timeout_s
    assert reasons == ["node 1 unheard for 0.5 s (dead, frozen or cut off)"]
    leader.close()


def test_after_rank_zero_announces_its_stop_its_silence_is_not_a_failure() -> None:
    nodes = two_nodes()
    store = host_store(nodes, 4)
    model = cached_checkpoint("llama")
    reasons: list[str] = []
    others = OtherNodes(store, identity(model), None, nodes, reasons.append)
    follower = NodeWatch(("127.0.0.1", store.port), 1, nodes, reasons.append)
    follower.watch(0)
    time.sleep(2 * nodes.node_timeout_s)
    others.ready()
    others.stop()
    assert follower.ready.wait(2.0)
    assert follower.stopping.wait(2.0)
    time.sleep(3 * nodes.node_timeout_s)  # rank 0 no longer beats
    assert reasons == []


def test_a_rendezvous_that_goes_away_loses_rank_zero() -> None:
    nodes = two_nodes()
    store = host_store(nodes, 4)
    reasons: list[str] = []
    follower = NodeWatch(("127.0.0.1", store.port), 1, nodes, reasons.append)
    follower.watch(0)
    del store  # rank 0's process is gone: its store with it
    deadline = time.monotonic() + 10 * nodes.node_timeout_s
    while not reasons and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reasons and ("stopped answering" in reasons[0] or "node 0 unheard" in reasons[0]), (
        reasons
    )
