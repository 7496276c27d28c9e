"""GPT-OSS: the Llama family's attention (biased projections, a sink logit per head,
sliding-window layers alternating with full ones, YaRN rope) and a mixture of experts with a
biased router and biased experts under a clamped SwiGLU (`layers/moe.py`, `layers/mlp.py`).

The loader renames the checkpoint's modules to headrace's and unstacks its experts: one
``experts.gate_up_proj`` [E, hidden, 2 x I] holds every expert's gate and up columns
interleaved (gate, up, gate, up, ...) and is multiplied as ``x @ W``; each expert becomes a
`GatedMLP` with gate rows then up rows, ``x @ W.T``. The experts' tensors are read whole (a
strided slice is no box of the file). MXFP4 checkpoints (the released weights) are refused:
headrace reads the float ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from headrace.worker.layers.weights import LoadedTensor, read
from headrace.worker.models.config import UnsupportedModelError
from headrace.worker.models.llama import LlamaForCausalLM

#: Checkpoint leaf names -> headrace's, outside the experts.
_RENAMED = {"self_attn.sinks": "self_attn.attn.sinks", "mlp.router": "mlp.gate"}


class GptOssForCausalLM(LlamaForCausalLM):
    def load_weights(
        self, tensors: Iterable[tuple[str, LoadedTensor]], complete: bool = True
    ) -> None:
        super().load_weights(self._headrace_names(tensors), complete)

    def _headrace_names(
        self, tensors: Iterable[tuple[str, LoadedTensor]]
    ) -> Iterator[tuple[str, LoadedTensor]]:
        for name, tensor in tensors:
            if self._stage_name(name) is None:
                continue  # another pipeline stage's: never read
            if name.endswith(("_blocks", "_scales")):
                raise UnsupportedModelError(f"{name}: MXFP4 weights are not supported")
            experts, _, stacked = name.rpartition(".experts.")
            if experts:
                yield from _unstacked(f"{experts}.experts", stacked, read(tensor))
                continue
            for old, new in _RENAMED.items():
                name = name.replace(f".{old}", f".{new}")
            yield name, tensor


def _unstacked(
    prefix: str, stacked: str, tensor: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's checkpoint pieces (Llama names) from a stacked tensor of all of them."""
    for expert, values in enumerate(tensor):
        module = f"{prefix}.{expert}"
        if stacked == "gate_up_proj":  # [hidden, 2 I], interleaved columns
            yield f"{module}.gate_proj.weight", values[:, 0::2].T
            yield f"{module}.up_proj.weight", values[:, 1::2].T
        elif stacked == "gate_up_proj_bias":  # [2 I], interleaved
            yield f"{module}.gate_proj.bias", values[0::2]
            yield f"{module}.up_proj.bias", values[1::2]
        elif stacked == "down_proj":  # [I, hidden]
            yield f"{module}.down_proj.weight", values.T
        else:  # down_proj_bias: [hidden]; anything else is refused by name
            yield f"{module}.{stacked.removesuffix('_bias')}.bias", values
