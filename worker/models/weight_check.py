"""Checking a weight update against the model before a single value is copied.

Design note. A worker must never serve half-updated weights, so every update is checked
whole (names, shapes, dtypes) before any rank copies anything. The check must refuse exactly
what a real load would refuse, and say it in the checkpoint's names. So `WeightChecker` holds
the whole model (every layer, unsplit: TP=1, PP=1) on PyTorch's meta device, whose tensors
have shapes but no memory, and runs each named tensor of an update through that model's own
`load_weights`: the same name mapping (fused q/k/v and gate/up, the tied head), the same
weight loaders and shape checks, fed a shape-only stand-in that reads nothing. A checkpoint
on disk is checked from its safetensors headers alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from headrace.kernels import select_kernels
from headrace.kernels.quantized import QuantizedWeight
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.weights import CheckpointTensor
from headrace.worker.models.interface import LoadableModel
from headrace.worker.models.loader import iter_weights
from headrace.worker.models.registry import model_factory, read_model_type

#: safetensors' dtype names (the header's "dtype") for the dtypes torch can hold.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One named tensor of an update, before (or without) its values."""

    #: The Hugging Face checkpoint's name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, tuple(tensor.shape), tensor.dtype)


class WeightsError(InvalidArgumentError):
    """An update that does not fit the model; the message names the tensor(s)."""

    def __init__(self, message: str) -> None:
        super().__init__("weights", message)


def checkpoint_metas(checkpoint_dir: Path) -> list[TensorMeta]:
    """Every tensor of a safetensors checkpoint, from the files' headers (no values read); a
    compressed-tensors layer as the float weight it stands for (its parts are read)."""
    if not checkpoint_dir.is_dir():
        raise InvalidArgumentError("path", f"{checkpoint_dir} is not a directory")
    metas = []
    for name, tensor in iter_weights(checkpoint_dir):
        if isinstance(tensor, QuantizedWeight):
            metas.append(TensorMeta(name, tensor.shape, torch.float32))
            continue
        assert isinstance(tensor, CheckpointTensor)
        dtype_name = tensor.source.get_dtype()
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise WeightsError(f"{name}: unsupported dtype {dtype_name}")
        metas.append(TensorMeta(name, tuple(tensor.shape), dtype))
    return metas


class _ShapeOnly:
    """A `SafeSlice` with a shape and no values: reading a box yields a meta tensor."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"  # (no values: any float dtype would do)

    def __getitem__(self, box: tuple[slice, ...]) -> torch.Tensor:
        return torch.empty([s.stop - s.start for s in box], device="meta")


class WeightChecker:
    """Refuses, naming the tensor, any update a real load of this model would refuse."""

    def __init__(self, model: LoadableModel) -> None:
        #: The whole model on the meta device (no memory).
        self.model = model

    @classmethod
    def for_model(cls, model_path: Path, hf_config: Any, dtype: torch.dtype) -> WeightChecker:
        factory = model_factory(read_model_type(model_path))
        kernels = select_kernels("reference", torch.device("cpu"))
        with torch.device("meta"):
            return cls(factory(hf_config, ParallelConfig(), dtype, kernels))

    def check_tensor(self, meta: TensorMeta) -> None:
        """One tensor on its own: a known name, the right shape, a float dtype."""
        self._load([meta], complete=False)

    def check_update(self, metas: Sequence[TensorMeta]) -> None:
        """A whole update: every tensor as in `check_tensor`, none twice, none missing."""
        seen: set[str] = set()
        for meta in metas:
            if meta.name in seen:
                raise WeightsError(f"{meta.name}: given twice")
            seen.add(meta.name)
        self._load(metas, complete=True)

    def _load(self, metas: Iterable[TensorMeta], complete: bool) -> None:
        for meta in metas:
            if not meta.dtype.is_floating_point:
                raise WeightsError(f"{meta.name}: dtype {meta.dtype} is not a floating-point type")
        tensors = ((m.name, CheckpointTensor.whole(m.name, _ShapeOnly(m.shape))) for m in metas)
        try:
            self.model.load_weights(tensors, complete=complete)
        except InvalidArgumentError as error:  # the loader's CheckpointError
            raise WeightsError(str(error).removeprefix(f"{error.field}: ")) from None
