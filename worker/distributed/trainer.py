"""The trainer's side of a weights group: join as rank 0, then broadcast each update.

    from headrace.sdk import Client
    from headrace.worker.distributed.trainer import TrainerGroup

    with Client("router:50051", api_key=ADMIN_KEY) as client:
        group = TrainerGroup.connect(client, host="10.0.0.5", port=29600)
        for step in ...:
            train(model)
            group.update(client, model.state_dict().items(), version=f"step-{step}")

Design note. `connect` asks the server how many ranks its workers have (the group is the
trainer plus all of them), then joins as rank 0, hosting the rendezvous, while the server's
`InitWeightsGroup` call has every rank join; it returns once both are done. `update` first
has the server check the update (`validate_only`), so a rejected update never touches the
group; then it starts the update call and broadcasts every tensor, in the order announced,
while every rank of every worker receives it and copies its shard; the call returns once all
have. If the call fails after it started (a worker died), the broadcasts cannot finish: the
group is closed and must be connected again. Tensors in a NCCL group must be on this
process's GPU, and each member of the group needs a GPU of its own.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

import torch
from headrace.sdk.client import Client
from headrace.sdk.weights import ControlReport
from headrace.worker.distributed.weight_sync import WeightGroup


class TrainerGroup:
    def __init__(self, group: WeightGroup) -> None:
        self.group: WeightGroup | None = group

    @classmethod
    def connect(
        cls,
        client: Client,
        host: str,
        port: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> TrainerGroup:
        """Create the group with every rank behind ``client`` (a worker or a router)."""
        world_size = 1 + client.control_state().num_ranks
        pool = concurrent.futures.ThreadPoolExecutor(2, "headrace-trainer-join")
        try:
            joined = pool.submit(
                client.init_weights_group,
                host,
                port,
                world_size,
                1,
                backend,
                group_timeout=timeout_s,
            )
            group = pool.submit(WeightGroup.join, host, port, world_size, 0, backend, timeout_s)
            pending: list[concurrent.futures.Future[Any]] = [joined, group]
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_EXCEPTION)
            joined.result()  # a refused call raises now, not after the rendezvous times out
            return cls(group.result())
        finally:
            pool.shutdown(wait=False)

    def update(
        self, client: Client, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str
    ) -> ControlReport:
        """Broadcast a whole update (checkpoint names); returns once every rank has it."""
        group = self._group()
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        specs = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors]
        client.update_weights_from_group(specs, version, validate_only=True)
        with concurrent.futures.ThreadPoolExecutor(1, "headrace-trainer-update") as pool:
            call = pool.submit(client.update_weights_from_group, specs, version)
            try:
                for _, tensor in tensors:
                    if call.done():
                        break  # it failed before taking everything: result() says why
                    group.broadcast(tensor.to(group.device).contiguous(), src=0)
            except Exception:
                self.close()
                raise
            try:
                return call.result()
            except Exception:
                self.close()
                raise

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def _group(self) -> WeightGroup:
        if self.group is None:
            raise RuntimeError("the weights group is closed: connect again")
        return self.group

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
