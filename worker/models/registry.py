"""Which headrace model runs which Hugging Face ``model_type``, and loading one from disk."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from headrace.kernels import KernelSet, select_kernels
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.linear import Layout, quantize_layers
from headrace.worker.layers.weights import LoadedTensor
from headrace.worker.models.compressed_tensors import COMPRESSED, read_scheme
from headrace.worker.models.config import UnsupportedModelError
from headrace.worker.models.families import FAMILIES
from headrace.worker.models.gemma import GemmaForCausalLM
from headrace.worker.models.gguf import iter_gguf_tensors
from headrace.worker.models.gpt_oss import GptOssForCausalLM
from headrace.worker.models.interface import LoadableModel
from headrace.worker.models.llama import LlamaForCausalLM
from headrace.worker.models.loader import iter_weights
from headrace.worker.models.phi3 import Phi3ForCausalLM
from torch import nn

__all__ = ["MODEL_REGISTRY", "LoadedModel", "ModelWeights", "UnsupportedModelError", "load_model"]


#: Builds a model with uninitialised weights from (HF config, parallel config, dtype, kernels).
ModelFactory = Callable[[Any, ParallelConfig, torch.dtype, KernelSet], LoadableModel]

#: model_type (as in config.json) -> the factory of the model that runs it.
MODEL_REGISTRY: dict[str, ModelFactory] = {
    model_type: LlamaForCausalLM.from_hf_config for model_type in FAMILIES
} | {
    "gemma2": GemmaForCausalLM.from_hf_config,
    "gemma3_text": GemmaForCausalLM.from_hf_config,
    "phi3": Phi3ForCausalLM.from_hf_config,
    "gpt_oss": GptOssForCausalLM.from_hf_config,
}


@dataclass(frozen=True, slots=True)
class ModelWeights:
    """Where a model's weights come from, and how its linear layers hold them."""

    #: The Hugging Face folder: config.json, tokenizer, and the safetensors unless gguf_file.
    folder: Path
    #: "none", "int8", "int4", "gguf-q4" / "gguf-q8" or "compressed-tensors"
    #: (`ModelSpec.quantization`).
    quantization: str = "none"
    #: A GGUF file to read the tensors from instead (quantized ones as shipped).
    gguf_file: Path | None = None
    #: Quantized layers multiply activations quantized to int8 (`EngineConfig`).
    int8_activations: bool = False

    def tensors(self) -> Iterator[tuple[str, LoadedTensor]]:
        """The checkpoint's tensors, by Hugging Face name, unread where the format allows
        (quantized layers as `QuantizedWeight`s)."""
        if self.gguf_file is not None:
            yield from iter_gguf_tensors(self.gguf_file)
        else:
            yield from iter_weights(self.folder)

    def layouts(self) -> tuple[Layout, Layout | None] | None:
        """(linear, vocabulary table) layouts where not `QUANTIZED_LAYOUTS`' for the name: a
        compressed-tensors checkpoint's own (its table float)."""
        scheme = read_scheme(self.folder) if self.quantization == COMPRESSED else None
        return None if scheme is None else (scheme.layout, None)


@dataclass(slots=True)
class LoadedModel:
    #: The model, weights loaded, in eval mode, on the requested device and dtype.
    model: LoadableModel
    #: The checkpoint's transformers config (eos ids, max_position_embeddings, ...).
    hf_config: Any


def load_model(
    source: str | Path | ModelWeights,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelConfig | None = None,
    kernels: KernelSet | None = None,
) -> LoadedModel:
    """Build the model for a local HF checkpoint directory (or a `ModelWeights`: quantized,
    or its tensors from a GGUF file) and load its weights.

    ``kernels`` defaults to the device's own backend (Triton on CUDA, torch elsewhere)."""
    from transformers import AutoConfig

    if not isinstance(source, ModelWeights):
        source = ModelWeights(Path(source))
    factory = model_factory(read_model_type(source.folder))
    hf_config = AutoConfig.from_pretrained(source.folder)
    # Parameters are allocated straight on the target device, in the target dtype.
    with torch.device(device):
        model = factory(
            hf_config,
            parallel or ParallelConfig(),
            dtype,
            kernels or select_kernels("auto", device),
        )
    quantize_layers(
        cast(nn.Module, model), source.quantization, source.layouts(), source.int8_activations
    )
    model.load_weights(source.tensors())
    model.eval()
    return LoadedModel(model, hf_config)


def model_factory(model_type: str) -> ModelFactory:
    factory = MODEL_REGISTRY.get(model_type)
    if factory is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(MODEL_REGISTRY))})"
        )
    return factory


def read_model_type(path: Path) -> str:
    """config.json's model_type, read before transformers sees a type it may not know."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InvalidArgumentError("model", f"no config.json in {path}")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if not isinstance(model_type, str):
        raise UnsupportedModelError(f"{config_file} names no model_type")
    return model_type
