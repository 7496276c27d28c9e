"""Tensor-parallel linear layers (Megatron style).

- `ColumnParallelLinear` splits the output features: each rank computes its slice of y and
  no communication is needed. `MergedColumnParallelLinear` (gate/up) and `QKVParallelLinear`
  fuse several column-parallel projections into one matmul.
- `RowParallelLinear` splits the input features: each rank computes a partial sum of y from
  its slice of x (a column-parallel output), and an all-reduce adds the partials.

So an attention or MLP block costs one all-reduce, at its row-parallel output.

Each layer multiplies with its `KernelSet`'s `linear` (the CPU backend's C kernel for a
decode step's few rows), or torch's where it has none.

A layer may carry a `LinearDelta` (LoRA adapters, `headrace.worker.lora`): it adds its rows'
deltas to this rank's output, before a row-parallel layer's all-reduce, which sums the partial
deltas of the ranks' input slices as it sums the base layer's.

A layer may hold its weight quantized (`headrace.worker.layers.quantizable`): this rank's
shard as integers in groups, multiplied by the kernel set's `quantized_linear`. The quantized
shard of a row-parallel layer is its columns' groups, so a group must not straddle ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from headrace.kernels import KernelSet, quantized
from headrace.kernels.precision import linear
from headrace.kernels.quantized import QuantizedWeight
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.distributed.parallel import ParallelConfig, all_reduce, divide
from headrace.worker.layers.quantizable import Quantizable
from headrace.worker.layers.weights import (
    LoadedTensor,
    LoadTarget,
    ShardId,
    check_shape,
    load_into,
    new_parameter,
    read,
    shard_rows,
)
from torch import nn


class LinearDelta(Protocol):
    """Something a linear layer adds to its output (this rank's share), e.g. LoRA deltas."""

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the delta of input x ([T, in per rank] -> [T, out per rank])."""
        ...


class Matmul(Protocol):
    """A layer's matmul (`KernelSet.linear`)."""

    def __call__(
        self,
        x: torch.Tensor,  # [T, in]
        weight: torch.Tensor,  # [out, in]
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # [T, out]


class QuantizedMatmul(Protocol):
    """A quantized layer's matmul (`KernelSet.quantized_linear`)."""

    def __call__(
        self,
        x: torch.Tensor,  # [T, in]
        weight: QuantizedWeight,  # [out, in]
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor: ...  # [T, out]


def matmul_of(kernels: KernelSet | None) -> Matmul:
    """The backend's matmul; torch's (`precision.linear`) without a backend."""
    return linear if kernels is None else kernels.linear


def quantized_matmul_of(kernels: KernelSet | None) -> QuantizedMatmul:
    """The backend's quantized matmul; the reference's without a backend."""
    return quantized.linear if kernels is None else kernels.quantized_linear


@dataclass(frozen=True, slots=True)
class RowShard:
    """Where one checkpoint tensor's slice lands in a column-parallel parameter."""

    #: First row of the parameter this piece fills.
    offset: int
    #: Rows this rank holds of the piece.
    num_rows: int
    #: Which num_rows-sized block of the checkpoint tensor this rank takes.
    source_index: int
    #: Rows of the whole checkpoint tensor, to reject a mismatched checkpoint.
    full_rows: int


class _Adaptable(Quantizable):
    """A linear layer a `LinearDelta` may be attached to once the model is built (LoRA), and
    whose weight may be held quantized."""

    #: Added to this rank's output when set (LoRA adapters); None runs the base layer alone.
    lora: LinearDelta | None = None
    bias: nn.Parameter | None
    matmul: Matmul
    quantized_matmul: QuantizedMatmul

    def attach_delta(self, delta: LinearDelta) -> None:
        self.lora = delta

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ + b over this rank's weight, float or quantized ([T, in] -> [T, out])."""
        if self.quantized is None:
            return self.matmul(x, self.weight, bias)
        return self.quantized_matmul(x, self.quantized, bias)


class ColumnParallelLinear(_Adaptable):
    """y = x Wᵀ + b with W's output rows split across ranks; y stays split."""

    #: The checkpoint tensors this layer's parameters are assembled from.
    shard_ids: tuple[ShardId, ...] = (None,)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.matmul = matmul_of(kernels)
        self.quantized_matmul = quantized_matmul_of(kernels)
        self.input_size = input_size
        self.output_size = output_size
        size = parallel.tensor_parallel_size
        self._init_parameters(divide(output_size, size, "output size"), bias, dtype)

    def _init_parameters(
        self, output_size_per_rank: int, bias: bool, dtype: torch.dtype | None
    ) -> None:
        self.output_size_per_rank = output_size_per_rank
        shape = (output_size_per_rank, self.input_size)
        self.weight = new_parameter(shape, dtype, self.weight_loader, self.shard_ids)
        self.bias = None
        if bias:
            self.bias = new_parameter(shape[:1], dtype, self.weight_loader, self.shard_ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.multiply(x, self.bias)  # [T, output_size_per_rank]
        return y if self.lora is None else self.lora.add_to(x, y)

    def weight_loader(self, param: LoadTarget, loaded: LoadedTensor, shard_id: ShardId) -> None:
        """Copy this rank's rows of a full checkpoint weight or bias into ``param``."""
        shard = self._row_shard(shard_id)
        if loaded.shape[0] != shard.full_rows:
            raise ValueError(
                f"checkpoint tensor has {loaded.shape[0]} rows, expected {shard.full_rows}"
            )
        target = param.narrow(0, shard.offset, shard.num_rows)
        load_into(target, shard_rows(loaded, shard.source_index, shard.num_rows))

    def output_shard(self, shard_id: ShardId) -> RowShard:
        """Where this rank's rows of checkpoint tensor ``shard_id`` sit in its output."""
        return self._row_shard(shard_id)

    def _row_shard(self, shard_id: ShardId) -> RowShard:
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        return RowShard(
            0, self.output_size_per_rank, self.parallel.tensor_parallel_rank, self.output_size
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up).

    Each rank's output is [piece 0 slice | piece 1 slice | ...], so a rank can split it
    locally; shard id ``i`` names the ``i``-th checkpoint tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
    ) -> None:
        self.output_sizes = output_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            parallel=parallel,
            dtype=dtype,
            kernels=kernels,
        )

    def _row_shard(self, shard_id: ShardId) -> RowShard:
        assert isinstance(shard_id, int), f"unexpected shard {shard_id!r}"
        size = self.parallel.tensor_parallel_size
        offset = divide(sum(self.output_sizes[:shard_id]), size, "output size")
        num_rows = divide(self.output_sizes[shard_id], size, "output size")
        rank = self.parallel.tensor_parallel_rank
        return RowShard(offset, num_rows, rank, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, split across ranks by attention head.

    Each rank's output is [q heads | k heads | v heads] for its heads. When there are fewer
    KV heads than ranks, each KV head is replicated on tensor_parallel_size / num_kv_heads
    consecutive ranks (GQA keeps every query head next to its KV head).
    """

    shard_ids = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
    ) -> None:
        nn.Module.__init__(self)
        size = parallel.tensor_parallel_size
        self.parallel = parallel
        self.matmul = matmul_of(kernels)
        self.quantized_matmul = quantized_matmul_of(kernels)
        self.input_size = hidden_size
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_per_rank = divide(num_heads, size, "num_attention_heads")
        self.num_kv_heads_per_rank = kv_heads_per_rank(num_kv_heads, parallel)
        # Which num_kv_heads_per_rank-sized block of KV heads this rank holds.
        replicas = max(1, size // num_kv_heads)
        self.kv_head_index = parallel.tensor_parallel_rank // replicas
        self.q_size = self.num_heads_per_rank * head_dim
        self.kv_size = self.num_kv_heads_per_rank * head_dim
        self.output_size = (num_heads + 2 * num_kv_heads) * head_dim
        self._init_parameters(self.q_size + 2 * self.kv_size, bias, dtype)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q + 2 kv] -> q [T, q_size], k [T, kv_size], v [T, kv_size] (views)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v

    def _row_shard(self, shard_id: ShardId) -> RowShard:
        rank = self.parallel.tensor_parallel_rank
        if shard_id == "q":
            return RowShard(0, self.q_size, rank, self.num_heads * self.head_dim)
        full_rows = self.num_kv_heads * self.head_dim
        if shard_id == "k":
            return RowShard(self.q_size, self.kv_size, self.kv_head_index, full_rows)
        assert shard_id == "v", f"unexpected shard {shard_id!r}"
        return RowShard(self.q_size + self.kv_size, self.kv_size, self.kv_head_index, full_rows)


def kv_heads_per_rank(num_kv_heads: int, parallel: ParallelConfig) -> int:
    """KV heads each rank holds: an even split, or one replicated head when ranks outnumber them."""
    size = parallel.tensor_parallel_size
    if num_kv_heads >= size:
        return divide(num_kv_heads, size, "num_key_value_heads")
    divide(size, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
    return 1


class RowParallelLinear(_Adaptable):
    """y = x Wᵀ + b with W's input columns split across ranks; x arrives split, y is whole
    (or, with ``reduce_results=False``, this rank's partial sum, for a caller that adds
    several partials before one all-reduce: a mixture of experts)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        parallel: ParallelConfig,
        dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.matmul = matmul_of(kernels)
        self.quantized_matmul = quantized_matmul_of(kernels)
        self.input_size = input_size
        self.input_size_per_rank = divide(input_size, parallel.tensor_parallel_size, "input size")
        shape = (output_size, self.input_size_per_rank)
        self.weight = new_parameter(shape, dtype, self.weight_loader)
        self.bias = None
        if bias:
            # The bias is whole on every rank; only rank 0 adds it, before the all-reduce.
            self.bias = new_parameter((output_size,), dtype, self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, input_size_per_rank]
        bias = self.bias if self.parallel.tensor_parallel_rank == 0 else None
        y = self.multiply(x, bias)  # [T, output_size]: this rank's partial sum
        if self.lora is not None:
            y = self.lora.add_to(x, y)
        return all_reduce(y, self.parallel) if self.reduce_results else y

    def weight_loader(self, param: LoadTarget, loaded: LoadedTensor, shard_id: ShardId) -> None:
        """Copy this rank's input columns of the checkpoint weight (the bias is whole). A
        float weight for per-channel int8 is quantized whole first (every rank reads it all),
        so each rank's columns carry the full row's scale, as at one rank."""
        assert shard_id is None, f"unexpected shard {shard_id!r}"
        if param.dim() == 2:
            # The full width, so a checkpoint already cut to one rank's columns is refused.
            check_shape(loaded, (param.shape[0], self.input_size))
            start = self.parallel.tensor_parallel_rank * self.input_size_per_rank
            if _per_channel_int8(param) and not isinstance(loaded, QuantizedWeight):
                loaded = quantized.quantize_columns(read(loaded), start, self.input_size_per_rank)
            else:
                loaded = loaded.narrow(1, start, self.input_size_per_rank)
        load_into(param, loaded)


def _per_channel_int8(param: LoadTarget) -> bool:
    return (
        isinstance(param, QuantizedWeight)
        and param.bits == 8
        and (param.group_size == param.shape[1])
    )


#: Bits and group size of a quantized weight; a group of None is one per output row.
Layout = tuple[int, int | None]
#: Per way of holding the weights (`ModelSpec.quantization`): the linear layers' layout, then
#: the vocabulary table's (embedding and LM head), which stays at 8 bits so the logits keep
#: their precision where the layers take 4 (as llama.cpp's 4-bit files keep token_embd at 8
#: or 6). "gguf-q4" / "gguf-q8": a GGUF file's blocks of 32 as shipped (Q4_0 / Q4_1, or Q8_0,
#: as `ModelSpec` reads the file; a projection of another type is quantized into it) and its
#: Q8_0 table.
QUANTIZED_LAYOUTS: dict[str, tuple[Layout, Layout]] = {
    "int8": ((8, None), (8, None)),
    "int4": ((4, quantized.INT4_GROUP_SIZE), (8, None)),
    "gguf-q4": ((4, quantized.NIBBLE_BLOCK), (8, quantized.NIBBLE_BLOCK)),
    "gguf-q8": ((8, quantized.NIBBLE_BLOCK), (8, quantized.NIBBLE_BLOCK)),
}


def quantize_layers(
    model: nn.Module,
    quantization: str,
    layouts: tuple[Layout, Layout | None] | None = None,
    int8_activations: bool = False,
) -> None:
    """Hold every linear layer's weight, and the vocabulary table's, in the layouts
    ``quantization`` names (`QUANTIZED_LAYOUTS`), or in ``layouts`` (linear, table; a table
    layout of None keeps the table float) where given (before the weights load); "none"
    keeps them float. ``int8_activations``: the quantized layers (the table as LM head too)
    multiply int8 activations."""
    if layouts is None:
        if quantization not in QUANTIZED_LAYOUTS:
            return
        layouts = QUANTIZED_LAYOUTS[quantization]
    linear_layout, table_layout = layouts
    for name, module in model.named_modules():
        if not isinstance(module, Quantizable):
            continue
        linear = isinstance(module, _Adaptable)
        layout = linear_layout if linear else table_layout
        if layout is None:
            continue
        try:
            module.quantize(*layout, int8_activations=int8_activations)
        except ValueError as error:
            raise InvalidArgumentError(
                "quantization", f"{quantization} cannot hold {name}'s weight: {error}"
            ) from None
