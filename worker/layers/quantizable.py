"""A layer whose weight may be held quantized (linear layers, the vocabulary table).

`quantize` (called before the weights load) replaces the float ``weight`` parameter by a
`QuantizedWeight` of the same shape (`headrace.kernels.quantized`) and leaves in the
parameter's place only its shape and dtype (on the meta device), with a loader that hands
every checkpoint tensor to the layer's own ``weight_loader`` with the quantized weight as the
target. So the sharding code is the float layer's: float tensors are quantized per rank as
they land (at start and in weight updates alike), and quantized ones (GGUF blocks) are copied
as they are.
"""

from __future__ import annotations

import torch
from headrace.kernels import quantized
from headrace.kernels.quantized import QuantizedWeight
from headrace.worker.layers.weights import (
    LoadedTensor,
    LoadTarget,
    ShardId,
    new_parameter,
    shard_ids_of,
)
from torch import nn


class Quantizable(nn.Module):
    #: This rank's weight as integers (`quantize`); None: the float ``weight`` parameter.
    quantized: QuantizedWeight | None = None
    weight: nn.Parameter

    @property
    def device(self) -> torch.device:
        return self.weight.device if self.quantized is None else self.quantized.device

    def matrix(self) -> torch.Tensor | QuantizedWeight:
        """This rank's weight as the kernels read it: quantized, or the parameter."""
        return self.weight if self.quantized is None else self.quantized

    def quantize(self, bits: int, group_size: int | None, int8_activations: bool = False) -> None:
        """Hold the weight as ``bits``-bit integers in groups of ``group_size`` along its
        rows (None: one group per row) from now on, multiplied by int8 activations where
        asked; call before loading it (once: a second call, e.g. on a weight another
        layer shares, changes nothing)."""
        if self.quantized is not None:
            return
        rows, cols = self.weight.shape
        self.quantized = quantized.empty(
            (rows, cols), bits, group_size or cols, self.weight.device, int8_activations
        )
        shard_ids, dtype = shard_ids_of(self.weight), self.weight.dtype
        with torch.device("meta"):  # the shape and dtype only
            self.weight = new_parameter((rows, cols), dtype, self._load_quantized, shard_ids)

    def _load_quantized(self, param: nn.Parameter, loaded: LoadedTensor, shard_id: ShardId) -> None:
        assert self.quantized is not None
        self.weight_loader(self.quantized, loaded, shard_id)

    def weight_loader(self, param: LoadTarget, loaded: LoadedTensor, shard_id: ShardId) -> None:
        """Copy this rank's part of a checkpoint tensor into ``param`` (each layer's own)."""
        raise NotImplementedError
