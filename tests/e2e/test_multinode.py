"""A worker whose ranks span two "nodes": two process trees started independently on loopback.

Node 0 (``--nnodes 2 --node-rank 0``) serves gRPC and runs ranks 0-1 (stage 0, TP=2); node 1
(``--node-rank 1``, its health port on 127.0.0.2 so nothing relies on one host address) runs
ranks 2-3 (stage 1). Their commands are the deploy/ LeaderWorkerSet's, rendered with the
environment LWS gives each pod. They serve the single-rank worker's tokens whichever starts
first; a node with another model is refused; a node killed or frozen ends the worker within
its node timeout, and a router in front fails over to another worker, token-exact.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.worker.engine.llm import LLM

from tests.deploy.lws import lws_node_command
from tests.e2e.processes import (
    ServerProcess,
    load_report,
    start_router,
    start_worker,
    stream_through_a_fault,
    wait_for_text,
    wait_serving,
    wait_workers_up,
)
from tests.e2e.test_parallel_worker import alive, child_pids, wait_gone
from tests.e2e.test_weight_updates import free_port, run_trainer
from tests.factories import cached_checkpoint, hf_greedy
from tests.lora_factories import build_adapter

PROMPTS = ["the quick brown fox", "a story about the sea", "to be or not", "hello"]
GREEDY = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
#: The nodes' --node-timeout in these tests, and how soon after it the worker must be gone.
NODE_TIMEOUT_S = 2.0
EXIT_WITHIN_S = NODE_TIMEOUT_S + 8.0
#: The address node 1 binds its health port on (a second loopback address).
NODE1_HOST = "127.0.0.2"


def node_args(model: Path, node_rank: int, rendezvous_port: int) -> list[str]:
    """The deploy/ LeaderWorkerSet's command for this node, rendered with the environment LWS
    gives its pod, then made local: this test's model, CPU, free ports, no TLS or keys."""
    env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_WORKER_INDEX": str(node_rank)}
    env["LWS_GROUP_SIZE"] = "2"
    rendered = lws_node_command("leader" if node_rank == 0 else "worker", env)
    assert rendered[:2] == ["headrace", "worker"]
    assert f"--node-rank={node_rank}" in rendered and "--nnodes=2" in rendered
    assert "--dist-init-addr=127.0.0.1:29500" in rendered
    local = {
        "--model": str(model),
        "--device": "cpu",
        "--health-port": "0",
        "--node-timeout": str(NODE_TIMEOUT_S),
        "--dist-init-addr": f"127.0.0.1:{rendezvous_port}",
    }
    dropped = ("--tls-", "--api-key-file", "--metrics-port", "--port")
    args = []
    for arg in rendered[1:]:
        flag = arg.split("=", 1)[0]
        if flag in local:
            args.append(f"{flag}={local[flag]}")
        elif not flag.startswith(dropped):
            args.append(arg)
    return args


class FollowerNode:
    """Node 1 as a process tree of its own: ``headrace worker --node-rank 1``."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headrace.sdk.cli", *args, "--host", NODE1_HOST],
            stdout=subprocess.PIPE,
            stderr=log_path.open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            bufsize=0,
        )
        self.health_port = 0
        self.running = threading.Event()  # its ranks are started (it was admitted)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode().strip()
            if line.startswith("health on "):
                self.health_port = int(line.rsplit(":", 1)[1])
            if line.startswith("headrace worker node 1 of 2"):
                self.running.set()

    def tree(self) -> list[int]:
        """The node's process and its ranks."""
        return [self.proc.pid, *child_pids(self.proc.pid)]

    def health(self) -> int:
        with grpc.insecure_channel(f"{NODE1_HOST}:{self.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            status: int = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            return status

    def kill(self) -> None:
        if self.proc.poll() is not None:
            return  # gone; its ranks leave with it
        for pid in self.tree():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def leader_while(
    args: list[str], log_path: Path, meanwhile: Callable[[], FollowerNode]
) -> tuple[ServerProcess, FollowerNode]:
    """Start node 0 first; once it waits for the other node, ``meanwhile`` (on a thread)
    starts node 1. Node 0 itself is started on this thread: a server child is told to stop
    when the thread that started it ends (`launch.die_with_parent`)."""
    started: list[FollowerNode] = []

    def then() -> None:
        wait_for_text(log_path, "placement: 4 ranks on 2 nodes of 2")
        started.append(meanwhile())

    thread = threading.Thread(target=then, daemon=True)
    thread.start()
    leader = ServerProcess(args, log_path=log_path)
    thread.join()
    return leader, started[0]


@contextmanager
def two_nodes(
    model: Path, tmp_path: Path, follower_first: bool = True
) -> Iterator[tuple[ServerProcess, FollowerNode]]:
    """(node 0, node 1) serving, started in either order; both killed at the end."""
    port = free_port()
    leader_args, follower_args = node_args(model, 0, port), node_args(model, 1, port)
    leader_log, follower_log = tmp_path / "node0.log", tmp_path / "node1.log"
    if follower_first:
        follower = FollowerNode(follower_args, follower_log)
        time.sleep(1.0)  # it waits for node 0's rendezvous, retrying
        leader = ServerProcess(leader_args, log_path=leader_log)
    else:
        leader, follower = leader_while(
            leader_args, leader_log, lambda: FollowerNode(follower_args, follower_log)
        )
    try:
        yield leader, follower
    finally:
        follower.kill()
        leader.kill()


def generate(target: str) -> list[list[int]]:
    with Client(target) as client:
        return [client.generate(prompt, GREEDY).token_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def expected(tiny_model: Path, offline: LLM) -> list[list[int]]:
    """The single-rank tokens, which are transformers' greedy tokens."""
    single = [output.token_ids for output in offline.generate(PROMPTS, GREEDY)]
    prompts = [offline.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert single == hf_greedy(tiny_model, prompts, GREEDY.max_tokens)
    return single


def test_two_nodes_started_from_the_leaderworkerset_serve_the_single_rank_tokens(
    tiny_model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    with two_nodes(tiny_model, tmp_path, follower_first=True) as (leader, follower):
        assert len(child_pids(leader.proc.pid)) == 1  # rank 1; ranks 2-3 are node 1's
        assert len(follower.tree()) == 3
        assert generate(leader.target) == expected
        assert follower.health() == health_pb2.HealthCheckResponse.SERVING
        ranks = follower.tree() + child_pids(leader.proc.pid)
        assert leader.terminate() == 0
        assert follower.proc.wait(EXIT_WITHIN_S) == 0  # rank 0's stop plan ended its ranks
        assert wait_gone(ranks, 5.0) == []
    log = (tmp_path / "node0.log").read_text()
    assert "tensor parallel inside each node, pipeline stages across nodes" in log


def test_a_node_with_another_model_is_refused_and_the_right_one_then_joins(
    tiny_model: Path, expected: list[list[int]], tmp_path: Path
) -> None:
    """Node 0 first; a node 1 started with another checkpoint is refused (exit 1, the
    mismatch named); node 0 waits on, and the right node 1 joins. Killing node 0 then ends
    node 1 and its ranks."""
    other = cached_checkpoint("llama", max_position_embeddings=512, num_layers=3)
    port = free_port()
    leader_log = tmp_path / "node0.log"
    refused: list[int] = []

    def refuse_then_join() -> FollowerNode:
        wrong = FollowerNode(node_args(other, 1, port), tmp_path / "wrong.log")
        refused.append(wrong.proc.wait(60))
        return FollowerNode(node_args(tiny_model, 1, port), tmp_path / "node1.log")

    leader, follower = leader_while(node_args(tiny_model, 0, port), leader_log, refuse_then_join)
    assert refused == [1]
    refusal = f"node 1 refused: model_digest: node 0 has {tiny_model} "
    assert refusal in (tmp_path / "wrong.log").read_text()
    assert refusal in leader_log.read_text()
    try:
        assert generate(leader.target) == expected
        ranks = follower.tree()
        leader.proc.kill()
        assert follower.proc.wait(EXIT_WITHIN_S) != 0
        assert wait_gone(ranks, 5.0) == []
    finally:
        follower.kill()
        leader.kill()


def test_a_frozen_node_ends_the_worker_within_its_node_timeout(
    tiny_model: Path, tmp_path: Path
) -> None:
    """SIGSTOP of node 1's tree stands in for a cut network: no connection closes, the node
    just goes silent. Node 0 must not wait out the ten-minute collective timeout."""
    with two_nodes(tiny_model, tmp_path, follower_first=False) as (leader, follower):
        ranks = child_pids(leader.proc.pid)
        for pid in follower.tree():
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert leader.proc.wait(EXIT_WITHIN_S) != 0
        print(f"node 1 frozen -> worker gone in {time.monotonic() - frozen_at:.2f} s")
    log = (tmp_path / "node0.log").read_text()
    assert f"node 1 unheard for {NODE_TIMEOUT_S:g} s" in log
    assert wait_gone(ranks, 5.0) == []


def test_router_fails_over_when_node_one_is_killed_mid_stream(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """Streams spread over a single-rank worker and the two-node worker; node 1's whole process
    tree is killed mid-generation. Every stream completes, equal to the run without a fault."""
    prompts = [f"failover story {i}" for i in range(16)]
    config = GenerationConfig(max_tokens=60, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in offline.generate(prompts, config)]
    (tmp_path / "single").mkdir()
    with (
        start_worker(tiny_model, tmp_path / "single") as single,
        two_nodes(tiny_model, tmp_path) as (leader, follower),
        start_router([single.target, leader.target], log_path=tmp_path / "router.log") as router,
    ):
        assert wait_serving(router.target)
        wait_workers_up(tmp_path / "router.log", single.target, leader.target)
        killed_at: list[float] = []

        def kill_node_one() -> None:
            assert load_report(leader.target).running_requests > 0
            follower.kill()
            killed_at.append(time.time())

        got = stream_through_a_fault(router.target, prompts, config, kill_node_one)
        assert leader.proc.wait(EXIT_WITHIN_S) != 0
        worker_gone_s = time.time() - killed_at[0]
    assert got == want
    resumed = [
        line
        for line in (tmp_path / "router.log").read_text().splitlines()
        if "resuming request" in line
    ]
    assert resumed
    failover_s = log_time(resumed[0]) - killed_at[0]
    print(
        f"node 1 killed -> first stream resumed by the router {failover_s:.2f} s, "
        f"worker gone within {worker_gone_s:.2f} s"
    )


def log_time(line: str) -> float:
    """The wall-clock time of a log line ("2026-11-25 04:13:29,563 INFO ...")."""
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_weight_updates_adapters_and_sleep_reach_the_ranks_on_every_node(
    tiny_model: Path, tmp_path: Path
) -> None:
    """TP=2 with one rank per node (every all-reduce crosses between the nodes; PP would
    refuse LoRA): an adapter loaded, weights updated from disk and from a trainer's group,
    and a sleep, each through node 0's gRPC, act on node 1's rank too."""
    checkpoint_b = cached_checkpoint("llama", max_position_embeddings=512, seed=1)
    adapter = build_adapter(tiny_model, tmp_path / "adapter", seed=11, rank=8)
    prompts = [[5 + i, 17, 42 + i, 9, 100 + 3 * i] for i in range(3)]
    llm = LLM(str(tiny_model), lora_modules=(("a", str(adapter)),))
    want_a, want_lora = (
        [r.token_ids for r in llm.generate(prompts, GREEDY, adapter=name)] for name in (None, "a")
    )
    llm.close()
    want_b = [r.token_ids for r in LLM(str(checkpoint_b)).generate(prompts, GREEDY)]
    assert len({str(want_a), str(want_lora), str(want_b)}) == 3
    port = free_port()
    common = ["worker", "--model", str(tiny_model), "-tp", "2", "--nnodes", "2", "--enable-lora"]
    common += ["--ranks-per-node", "1", "--dist-init-addr", f"127.0.0.1:{port}"]
    follower = FollowerNode([*common, "--node-rank", "1"], tmp_path / "node1.log")
    leader = ServerProcess([*common, "--node-rank", "0"], log_path=tmp_path / "node0.log")
    try:
        with Client(leader.target) as client:

            def served(adapter: str = "") -> list[list[int]]:
                return [client.generate(p, GREEDY, adapter=adapter).token_ids for p in prompts]

            assert served() == want_a
            client.load_lora_adapter("a", str(adapter))
            assert served("a") == want_lora
            report = client.update_weights(str(checkpoint_b), version="b-disk")
            assert report.num_ranks == 2 and served() == want_b
            assert "versions a-group" in run_trainer(leader.target, tiny_model, "a-group")
            assert served() == want_a
            client.sleep()
            client.wake_up()
            assert served() == want_a and served("a") == want_lora
        assert leader.terminate() == 0
        assert follower.proc.wait(EXIT_WITHIN_S) == 0
    finally:
        follower.kill()
        leader.kill()
    assert "tensor-parallel groups of 2 span nodes" in (tmp_path / "node0.log").read_text()
