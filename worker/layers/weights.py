"""How a parameter says which part of a checkpoint tensor it holds.

Every parameter carries a ``weight_loader(param, full_tensor, shard_id)`` that copies this
rank's slice of a *full* checkpoint tensor into it, so the loader never needs to know about
tensor parallelism or fused projections. A fused parameter (q/k/v, gate/up) also carries
``shard_ids``: the checkpoint pieces it is assembled from, so the loader can tell which are
missing. Both ride on the `nn.Parameter` itself (as in vLLM) so `named_parameters()` is the
whole map of what to load.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: Names one piece of a fused parameter: "q" / "k" / "v" for QKV, 0 / 1 for gate / up.
#: None means the parameter maps to exactly one checkpoint tensor.
ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId) -> None:
    """Copy a whole (unsharded) tensor, converting its dtype."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unfused parameter"
    check_shape(param.data, loaded)
    param.data.copy_(loaded)


def check_shape(target: torch.Tensor, loaded: torch.Tensor) -> None:
    if target.shape != loaded.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
        )


def new_parameter(
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    loader: WeightLoader = default_weight_loader,
    shard_ids: tuple[ShardId, ...] = (None,),
) -> nn.Parameter:
    """An uninitialised inference-only parameter on the current default device."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def shard_ids_of(param: nn.Parameter) -> tuple[ShardId, ...]:
    shard_ids: tuple[ShardId, ...] = getattr(param, "shard_ids", (None,))
    return shard_ids


def shard_rows(loaded: torch.Tensor, rank: int, num_rows: int) -> torch.Tensor:
    """Rank ``rank``'s block of ``num_rows`` along dim 0."""
    return loaded.narrow(0, rank * num_rows, num_rows)
