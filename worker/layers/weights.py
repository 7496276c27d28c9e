"""How a parameter says which part of a checkpoint tensor it holds.

Every parameter carries a ``weight_loader(param, loaded, shard_id)`` that copies this rank's
slice of a *full* checkpoint tensor into it, so the loader never needs to know about tensor
parallelism or fused projections. A fused parameter (q/k/v, gate/up) also carries
``shard_ids``: the checkpoint pieces it is assembled from, so the loader can tell which are
missing. Both ride on the `nn.Parameter` itself (as in vLLM) so `named_parameters()` is the
whole map of what to load.

``loaded`` is either a tensor in memory or a `CheckpointTensor`: a handle on a tensor still in
the file. A weight loader checks shapes and narrows first and calls `read` last, so each
tensor-parallel rank reads only its own shard from disk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from headrace.kernels.quantized import QuantizedWeight, dequantize
from torch import nn

#: Names one piece of a fused parameter: "q" / "k" / "v" for QKV, 0 / 1 for gate / up.
#: None means the parameter maps to exactly one checkpoint tensor.
ShardId = str | int | None


class SafeSlice(Protocol):
    """What `CheckpointTensor` uses of safetensors' ``safe_open(...).get_slice(name)``."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...  # safetensors' name: "F32", "BF16", "I8", ...

    def __getitem__(self, box: tuple[slice, ...]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    """A box of a checkpoint tensor that has not been read from disk yet.

    It offers the part of `torch.Tensor` a weight loader looks at (``shape``, `dim`,
    `narrow`) without reading; `read` then reads only the box. Valid while the file it comes
    from is open, i.e. until `iter_checkpoint` moves past it.
    """

    #: The checkpoint's name for the whole tensor.
    name: str
    #: safetensors' handle on the whole tensor; indexing it reads that region of the file.
    source: SafeSlice
    #: Where the box starts in the whole tensor, per dim.
    starts: tuple[int, ...]
    #: The box's size per dim (the whole tensor's until narrowed).
    shape: torch.Size

    @classmethod
    def whole(cls, name: str, source: SafeSlice) -> CheckpointTensor:
        shape = torch.Size(source.get_shape())
        return cls(name, source, (0,) * len(shape), shape)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Like `torch.Tensor.narrow`, but only moves the box: nothing is read."""
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(
                f"cannot narrow dim {dim} of {tuple(self.shape)} to [{start}, {start + length})"
            )
        starts, shape = list(self.starts), list(self.shape)
        starts[dim] += start
        shape[dim] = length
        return replace(self, starts=tuple(starts), shape=torch.Size(shape))

    def read(self) -> torch.Tensor:
        """The box's values, read from the file (only the box), in the checkpoint's dtype."""
        box = zip(self.starts, self.shape, strict=True)
        return self.source[tuple(slice(start, start + size) for start, size in box)]


#: What a weight loader is given: a tensor in memory (tests, callers holding weights), one
#: still on disk, or quantized weights as a file ships them (GGUF).
LoadedTensor = torch.Tensor | CheckpointTensor | QuantizedWeight
#: What a weight loader fills: a parameter (or a view of it), or a quantized layer's weight,
#: which quantizes float values as they land.
LoadTarget = torch.Tensor | QuantizedWeight
WeightLoader = Callable[[nn.Parameter, LoadedTensor, ShardId], None]


def read(loaded: LoadedTensor) -> torch.Tensor:
    """``loaded`` in memory as floats: a `CheckpointTensor` is read from disk now (only its
    box), quantized weights are dequantized (for a float parameter: an embedding, a norm)."""
    if isinstance(loaded, CheckpointTensor):
        return loaded.read()
    return dequantize(loaded) if isinstance(loaded, QuantizedWeight) else loaded


def default_weight_loader(param: nn.Parameter, loaded: LoadedTensor, shard_id: ShardId) -> None:
    """Copy a whole (unsharded) tensor, converting its dtype."""
    assert shard_id is None, f"unexpected shard {shard_id!r} for an unfused parameter"
    load_into(param, loaded)


def load_into(target: LoadTarget, loaded: LoadedTensor) -> None:
    """Copy ``loaded`` into ``target`` (converting the dtype); a misshapen tensor is refused
    before anything is read. ``target`` is the parameter or a view of it, never its ``.data``:
    the write then moves the parameter's version, which tells `kernels.prepacked` to pack
    the weight again. Quantized weights land in a quantized target as they are."""
    check_shape(loaded, target.shape)
    if isinstance(target, QuantizedWeight) and isinstance(loaded, QuantizedWeight):
        target.copy_(loaded)
    else:
        target.copy_(read(loaded))


def check_shape(loaded: LoadedTensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
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


def shard_rows(loaded: LoadedTensor, rank: int, num_rows: int) -> LoadedTensor:
    """Rank ``rank``'s block of ``num_rows`` along dim 0."""
    return loaded.narrow(0, rank * num_rows, num_rows)
