"""Phi-3: a Llama whose checkpoint fuses q/k/v into one ``qkv_proj`` and gate/up into one
``gate_up_proj`` (headrace's own fused layers, in the same order), with a sliding window on
every layer (Phi-3-mini-4k) or longrope (the 128k models, run within their original context:
`config._longrope_config`).

The loader cuts each fused tensor back into the checkpoint pieces the layers load (q, k, v;
gate, up), as views of the tensor still on disk, so tensor parallelism reads only each
rank's rows exactly as it does for a Llama checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from headrace.kernels import KernelSet
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.weights import LoadedTensor
from headrace.worker.models.config import ModelConfig
from headrace.worker.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        dtype: torch.dtype,
        kernels: KernelSet,
    ) -> None:
        super().__init__(config, parallel, dtype, kernels)
        config = self.config
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        #: A fused checkpoint module -> its pieces (checkpoint names) and their rows, in
        #: order; LoRA adapters of the fused modules are cut the same way (`worker/lora`).
        self.fused_pieces = {
            "qkv_proj": (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)),
            "gate_up_proj": (
                ("gate_proj", config.intermediate_size),
                ("up_proj", config.intermediate_size),
            ),
        }

    def load_weights(
        self, tensors: Iterable[tuple[str, LoadedTensor]], complete: bool = True
    ) -> None:
        super().load_weights(self._unfused(tensors), complete)

    def _unfused(
        self, tensors: Iterable[tuple[str, LoadedTensor]]
    ) -> Iterator[tuple[str, LoadedTensor]]:
        for name, tensor in tensors:
            module, _, leaf = name.rpartition(".")  # leaf: "weight"
            parent, _, fused = module.rpartition(".")
            split = self.fused_pieces.get(fused)
            if split is None or not hasattr(tensor, "narrow"):
                yield name, tensor
                continue
            start = 0
            for piece, num_rows in split:
                yield f"{parent}.{piece}.{leaf}", tensor.narrow(0, start, num_rows)
                start += num_rows
