"""Named tensors assembled from an `UpdateWeightsFromTensors` stream.

Design note. A tensor arrives as consecutive `WeightsChunk`s (a gRPC message is far smaller
than an embedding matrix). Each tensor is checked against the model on its first chunk (a
known name, the right shape, a wire dtype), before any of its bytes are kept, so an update
that could never load costs the client one chunk, and the worker holds at most one copy of
the model's weights while a stream lasts. The chunks of a tensor must come together and in
order; the stream's end checks that no tensor is short and none is missing. Nothing is
copied into the model here: the caller hands the finished set to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from headrace.protos import control_pb2 as cpb
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.weights import WIRE_DTYPES
from headrace.worker.models.weight_check import TensorMeta, WeightChecker, WeightsError

TORCH_DTYPES = {name: getattr(torch, name) for name in WIRE_DTYPES}


def torch_dtype(name: str, tensor_name: str) -> torch.dtype:
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        raise WeightsError(f"{tensor_name}: dtype must be one of {WIRE_DTYPES}, got {name!r}")
    return dtype


@dataclass(slots=True)
class _Filling:
    """The tensor whose chunks are arriving."""

    name: str
    tensor: torch.Tensor
    #: The tensor's bytes, as a writable array.
    raw: np.ndarray
    num_filled: int = 0


class TensorAssembler:
    def __init__(self, checker: WeightChecker) -> None:
        self.checker = checker
        self.tensors: dict[str, torch.Tensor] = {}
        self._filling: _Filling | None = None

    def add(self, chunk: cpb.WeightsChunk) -> None:
        """Take one chunk; raises InvalidArgumentError (naming the tensor) for a bad one."""
        if self._filling is None or chunk.name != self._filling.name:
            self._finish_tensor()
            self._filling = self._start(chunk)
        filling = self._filling
        if chunk.offset != filling.num_filled:
            raise WeightsError(
                f"{chunk.name}: chunk at byte {chunk.offset}, expected {filling.num_filled} "
                "(a tensor's chunks must come in order)"
            )
        data = chunk.data  # (each read of a bytes field copies it)
        end = filling.num_filled + len(data)
        if end > len(filling.raw):
            raise WeightsError(f"{chunk.name}: more than its {len(filling.raw)} bytes")
        filling.raw[filling.num_filled : end] = np.frombuffer(data, dtype=np.uint8)
        filling.num_filled = end

    def finish(self) -> tuple[tuple[str, torch.Tensor], ...]:
        """Every tensor of the stream, checked as a whole update."""
        self._finish_tensor()
        self.checker.check_update([TensorMeta.of(n, t) for n, t in self.tensors.items()])
        return tuple(self.tensors.items())

    def _start(self, chunk: cpb.WeightsChunk) -> _Filling:
        if not chunk.name:
            raise InvalidArgumentError("name", "every chunk after the first must name a tensor")
        if chunk.name in self.tensors:
            raise WeightsError(f"{chunk.name}: sent twice (or its chunks did not come together)")
        if any(size < 0 for size in chunk.shape):
            raise WeightsError(f"{chunk.name}: negative size in shape {list(chunk.shape)}")
        meta = TensorMeta(chunk.name, tuple(chunk.shape), torch_dtype(chunk.dtype, chunk.name))
        self.checker.check_tensor(meta)
        tensor = torch.empty(meta.shape, dtype=meta.dtype)
        return _Filling(chunk.name, tensor, tensor.view(-1).view(torch.uint8).numpy())

    def _finish_tensor(self) -> None:
        filling = self._filling
        if filling is None:
            return
        if filling.num_filled != len(filling.raw):
            raise WeightsError(
                f"{filling.name}: got {filling.num_filled} of its {len(filling.raw)} bytes"
            )
        self.tensors[filling.name] = filling.tensor
        self._filling = None
