"""The LoRA slots of one linear layer: every device-resident adapter's A and B, stacked.

A layer's output is one or more checkpoint modules side by side (``qkv_proj`` is q | k | v,
``gate_up_proj`` is gate | up); each is a *piece* with its own A and B. The pieces' A are
stacked on the rank axis, so one shrink serves them all; each piece expands into its own
columns. Tensor parallelism splits an adapter like its base layer: a column-parallel piece
keeps A whole and takes this rank's rows of B; a row-parallel layer takes this rank's input
columns of A and keeps B whole, and the base layer's all-reduce sums the partial deltas.
Scaling is folded into B, kept transposed ([R, out], as the expand reads it); ranks below the
maximum are zero-padded (zeros add nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from headrace.kernels import KernelSet
from headrace.kernels.lora import LoraIndices
from headrace.worker.layers.linear import ColumnParallelLinear, RowParallelLinear, RowShard
from headrace.worker.layers.weights import ShardId


@dataclass(slots=True)
class LoraBatch:
    """The current forward pass's rows → slots, shared by every layer of one model (the
    model's `LoraManager` sets it before each pass; the layers only read it)."""

    indices: LoraIndices | None = None


@dataclass(frozen=True, slots=True)
class LoraPiece:
    shard_id: ShardId
    #: Where this rank's rows of the piece's B sit in the layer's output, and which rows.
    shard: RowShard


class LinearLora:
    """A `LinearDelta`: the per-row LoRA deltas of one linear layer."""

    def __init__(
        self,
        layer: ColumnParallelLinear | RowParallelLinear,
        batch: LoraBatch,
        kernels: KernelSet,
        num_slots: int,
        max_rank: int,
    ) -> None:
        self.batch = batch
        self.kernels = kernels
        self.max_rank = max_rank
        self.input_size = layer.input_size
        weight = layer.weight
        self.pieces: tuple[LoraPiece, ...]
        if isinstance(layer, RowParallelLinear):
            out = weight.shape[0]
            self.pieces = (LoraPiece(None, RowShard(0, out, 0, out)),)
            self.input_slice = (
                layer.parallel.tensor_parallel_rank * layer.input_size_per_rank,
                layer.input_size_per_rank,
            )
        else:
            self.pieces = tuple(LoraPiece(s, layer.output_shard(s)) for s in layer.shard_ids)
            self.input_slice = (0, layer.input_size)
        dtype, device = weight.dtype, layer.device  # (a quantized layer's weight is a shape)
        shape_a = (num_slots, len(self.pieces) * max_rank, self.input_slice[1])
        self.lora_a = torch.zeros(shape_a, dtype=dtype, device=device)
        self.lora_b = [
            torch.zeros((num_slots, max_rank, p.shard.num_rows), dtype=dtype, device=device)
            for p in self.pieces
        ]

    def full_shapes(self, shard_id: ShardId) -> tuple[int, int] | None:
        """(in, out) of the checkpoint module ``shard_id`` names, or None if it is not ours."""
        for piece in self.pieces:
            if piece.shard_id == shard_id:
                return self.input_size, piece.shard.full_rows
        return None

    def set_slot(
        self, slot: int, weights: dict[ShardId, tuple[torch.Tensor, torch.Tensor]], scaling: float
    ) -> None:
        """Fill ``slot`` with one adapter's full A [r, in] and B [out, r] per piece (pieces it
        does not adapt are zeroed)."""
        self.lora_a[slot].zero_()
        start, width = self.input_slice
        for i, piece in enumerate(self.pieces):
            b_slot = self.lora_b[i][slot]
            b_slot.zero_()
            if piece.shard_id not in weights:
                continue
            a, b = weights[piece.shard_id]
            rank, shard = a.shape[0], piece.shard
            first = i * self.max_rank
            self.lora_a[slot, first : first + rank].copy_(a.narrow(1, start, width))
            rows = b.narrow(0, shard.source_index * shard.num_rows, shard.num_rows)
            b_slot[:rank].copy_(rows.t() * scaling)  # stored [R, out]: a row per rank

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        indices = self.batch.indices
        if indices is None or not indices.active:
            return y
        h = self.kernels.lora_shrink(x, self.lora_a, indices)  # [T, pieces * max_rank]
        for i, piece in enumerate(self.pieces):
            h_piece = h[:, i * self.max_rank : (i + 1) * self.max_rank]
            self.kernels.lora_expand(h_piece, self.lora_b[i], indices, y, piece.shard.offset)
        return y
