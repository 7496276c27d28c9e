"""Where a worker's ranks meet: the store rank 0 hosts, the admission of other nodes, and
the heartbeats that end the worker when a node is lost.

Rank 0 hosts a `TCPStore`: on a free loopback port when every rank is on its node, on
``dist_init_addr``'s port (every interface) when ranks run on other nodes too. Every rank
joins the process group through it; other nodes also meet rank 0 there first:

1. **Admission.** Node r > 0 writes `hello/r` (a nonce and its `NodeIdentity`: version, model,
   sizes) and waits for `answer/r/<nonce>`. Rank 0 compares the identity with its own and
   answers with the `RankSetup` its ranks build from (the shard plan), or with a message
   naming every mismatch; a refused node exits, and rank 0 keeps waiting for a right one.
2. **Heartbeats.** Every node counts up `beat/<node>` a few times per ``node_timeout_s``. Rank
   0 watches every admitted node; the others watch rank 0. A node unheard for
   ``node_timeout_s`` (killed, frozen, cut off) or a rendezvous that stops answering ends the
   worker within seconds, where a collective would wait out its ten-minute timeout.
   `stopping` (set by rank 0 before its stop plan) tells the others that rank 0's silence
   from then on is an orderly stop.

The store is unauthenticated, like torch.distributed's own rendezvous: its port (and the
collectives') must be reachable only by the worker's own nodes (deploy/'s NetworkPolicy).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import importlib.metadata
import json
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch.distributed as dist
from headrace.sdk.errors import FailedPreconditionError
from headrace.worker.distributed.nodes import NodeConfig
from headrace.worker.models.registry import ModelWeights

logger = logging.getLogger(__name__)

#: How long ranks and nodes wait for each other at start-up and inside one collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
#: Heartbeats per node timeout (a node is lost after missing about this many in a row).
BEATS_PER_TIMEOUT = 5
#: How often rank 0 looks for a node's hello.
ADMISSION_POLL_S = 0.1
_PREFIX = "headrace/"
_STOPPING = _PREFIX + "stopping"
_READY = _PREFIX + "ready"


class NodeRefusedError(FailedPreconditionError):
    """Rank 0 refused this node: it was started with another model, sizes or version."""


def host_store(nodes: NodeConfig, world_size: int) -> dist.TCPStore:
    """Rank 0's store: a free loopback port for one node, dist_init_addr's port for several."""
    host, port = nodes.rendezvous() if nodes.is_multi_node else ("127.0.0.1", 0)
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=COLLECTIVE_TIMEOUT,
        wait_for_workers=False,  # the ranks connect later, each when it starts
    )


def connect_store(
    host: str, port: int, world_size: int, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT
) -> dist.TCPStore:
    """A client of rank 0's store; it retries connecting until ``timeout`` (rank 0 may start
    after this node)."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What every node of one worker must agree on before it may join."""

    version: str
    #: The model as the node was given it (for messages) and a digest of its config.
    model: str
    model_digest: str
    quantization: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    nnodes: int
    ranks_per_node: int

    @classmethod
    def of(
        cls, model: str, source: ModelWeights, tp: int, pp: int, nodes: NodeConfig
    ) -> NodeIdentity:
        config = json.loads((source.folder / "config.json").read_text())
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
        gguf = source.gguf_file.name if source.gguf_file is not None else ""
        return cls(
            version=importlib.metadata.version("headrace"),
            model=model,
            model_digest=digest + (f" ({gguf})" if gguf else ""),
            quantization=source.quantization,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            nnodes=nodes.nnodes,
            ranks_per_node=nodes.local_size(tp * pp),
        )

    def mismatches(self, joining: NodeIdentity) -> list[str]:
        """Each way ``joining`` differs from this (rank 0's) identity, named."""
        problems = []
        for item in fields(self):
            if item.name == "model":
                continue  # the same checkpoint may sit at different paths on each node
            mine, theirs = getattr(self, item.name), getattr(joining, item.name)
            if mine != theirs:
                if item.name == "model_digest":
                    mine, theirs = f"{self.model} {mine}", f"{joining.model} {theirs}"
                problems.append(f"{item.name}: node 0 has {mine}, this node {theirs}")
        return problems


def join(store: dist.Store, node_rank: int, identity: NodeIdentity) -> Any:
    """Node ``node_rank``'s side of admission: rank 0's `RankSetup`, or NodeRefusedError."""
    nonce = uuid.uuid4().hex
    _put(store, f"{_PREFIX}hello/{node_rank}", (nonce, identity))
    answer = _take(store, f"{_PREFIX}answer/{node_rank}/{nonce}")
    if isinstance(answer, str):
        raise NodeRefusedError(answer)
    return answer


def _put(store: dist.Store, key: str, value: object) -> None:
    store.set(key, base64.b64encode(pickle.dumps(value)).decode())


def _take(store: dist.Store, key: str) -> Any:
    """The value at ``key``, waiting for it up to the store's timeout."""
    return pickle.loads(base64.b64decode(store.get(key)))


class NodeAdmission:
    """Rank 0's side of admission: one thread per other node, answering its hellos."""

    def __init__(
        self,
        store: dist.Store,
        identity: NodeIdentity,
        setup: object,
        on_admitted: Callable[[int], None],
    ) -> None:
        self.store = store
        self.identity = identity
        self.setup = setup
        self.on_admitted = on_admitted
        self.closed = threading.Event()
        for node in range(1, identity.nnodes):
            threading.Thread(
                target=self._admit, args=(node,), name=f"headrace-admit-{node}", daemon=True
            ).start()

    def _admit(self, node: int) -> None:
        hello = f"{_PREFIX}hello/{node}"
        while not self.closed.wait(ADMISSION_POLL_S):
            try:
                if not self.store.check([hello]):
                    continue  # not here yet
                nonce, joining = _take(self.store, hello)
            except dist.DistError:
                return  # the store is closing: rank 0 is ending
            self.store.delete_key(hello)
            problems = self.identity.mismatches(joining)
            answer = f"{_PREFIX}answer/{node}/{nonce}"
            if problems:
                message = f"node {node} refused: " + "; ".join(problems)
                logger.error("%s", message)
                _put(self.store, answer, message)
                continue  # a node started again with the right flags may still join
            logger.info("node %d joined (%s)", node, joining.model)
            self.on_admitted(node)
            _put(self.store, answer, self.setup)
            return

    def close(self) -> None:
        self.closed.set()


class NodeWatch:
    """This node's heartbeat, and the watch over the nodes it depends on.

    Runs on a store connection of its own whose operations time out after the node timeout,
    so a rendezvous that stops answering is noticed as surely as a silent node.
    """

    def __init__(
        self,
        address: tuple[str, int],
        node_rank: int,
        nodes: NodeConfig,
        on_lost: Callable[[str], None],
    ) -> None:
        self.node_rank = node_rank
        self.timeout_s = nodes.node_timeout_s
        self.on_lost = on_lost
        self.address = address
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = connect_store(*address, world_size=1, timeout=timeout)
        #: Node -> (last beat count seen, when it last changed).
        self._seen: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._run, name="headrace-node-watch", daemon=True).start()

    def watch(self, node: int) -> None:
        """Start watching ``node``'s heartbeat (from now: it has a full timeout to beat)."""
        with self._lock:
            self._seen[node] = (-1, time.monotonic())

    def close(self) -> None:
        self.closed.set()

    def _run(self) -> None:
        interval = self.timeout_s / BEATS_PER_TIMEOUT
        while not self.closed.wait(interval):
            try:
                lost = self._beat()
            except Exception as exc:  # the store is rank 0's: it is gone or cut off
                lost = f"the rendezvous at {self.address[0]}:{self.address[1]} stopped answering"
                lost += f" ({type(exc).__name__})"
            if self.stopping.is_set() or self.closed.is_set():
                return
            if lost is not None:
                self.on_lost(lost)
                return

    def _beat(self) -> str | None:
        """Beat once, read the watched nodes' beats; the reason a node is lost, if one is."""
        self.store.add(f"{_PREFIX}beat/{self.node_rank}", 1)
        if self.store.check([_STOPPING]):
            self.stopping.set()
        if not self.ready.is_set() and self.store.check([_READY]):
            self.ready.set()
        now = time.monotonic()
        with self._lock:
            watched = list(self._seen.items())
        for node, (count, since) in watched:
            beats = self.store.add(f"{_PREFIX}beat/{node}", 0)
            if beats != count:
                with self._lock:
                    self._seen[node] = (beats, now)
            elif now - since > self.timeout_s:
                return f"node {node} unheard for {self.timeout_s:g} s (dead, frozen or cut off)"
        return None


class OtherNodes:
    """Rank 0's side of the worker's other nodes: their admission, the watch over their
    heartbeats, and the announcements (ready, stopping) they wait for."""

    def __init__(
        self,
        store: dist.TCPStore,
        identity: NodeIdentity,
        setup: object,
        nodes: NodeConfig,
        on_lost: Callable[[str], None],
    ) -> None:
        self.store = store
        # Connections of their own (a store client is not safe to share between threads,
        # and rank 0's joins the process group meanwhile); the store listens on every
        # interface, so rank 0 reaches it on loopback.
        address = ("127.0.0.1", store.port)
        self.watch = NodeWatch(address, 0, nodes, on_lost)
        admission_store = connect_store(*address, world_size=1)
        self.admission = NodeAdmission(admission_store, identity, setup, self.watch.watch)

    def ready(self) -> None:
        """Every rank has built its shard (the other nodes' health turns SERVING)."""
        self.store.set(_READY, "1")

    def stop(self) -> None:
        """Before the stop plan: rank 0's silence from now on is not a failure."""
        self.store.set(_STOPPING, "1")
        self.admission.close()
        self.watch.close()
