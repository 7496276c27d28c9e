"""A LoRA adapter in PEFT's format, read from disk into host memory.

A PEFT adapter directory holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` with, per adapted
module, ``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r].
The delta of a module is scaling · B A x, scaling = alpha / r (alpha / sqrt(r) with rsLoRA).

What this reader refuses (InvalidArgumentError, at load): a missing or unreadable file, a
rank above the worker's maximum, and what headrace does not apply (per-module rank or alpha
patterns, DoRA, trained biases, extra saved modules). Whether the model has the adapter's
target modules is checked by the `LoraManager`, which knows the model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.errors import InvalidArgumentError
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT prefixes every module name with the wrapper's path.
_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter's full (unsharded) weights in host memory."""

    name: str
    path: Path
    rank: int
    #: alpha / r, or alpha / sqrt(r) with rsLoRA: folded into B when the adapter takes a slot.
    scaling: float
    #: Checkpoint module name (``model.layers.0.self_attn.q_proj``) -> (A [r, in], B [out, r]).
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(name: str, path: str | Path, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """The adapter at ``path``, its tensors in ``dtype`` on the CPU; InvalidArgumentError
    naming what is wrong."""
    directory = Path(path)
    config = _read_config(directory)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise InvalidArgumentError("path", f"{CONFIG_FILE} has no valid rank r: {rank!r}")
    if rank > max_rank:
        raise InvalidArgumentError(
            "path",
            f"adapter {name!r} has rank {rank}; this worker takes at most {max_rank} "
            "(--max-lora-rank)",
        )
    _check_supported(config)
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _read_weights(directory, rank, dtype)
    return LoraAdapter(name, directory, rank, float(scaling), weights)


def _read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError("path", f"cannot read {directory / CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidArgumentError("path", f"{CONFIG_FILE} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidArgumentError("path", f"not a LoRA adapter (peft_type {peft_type!r})")
    return config


def _check_supported(config: dict[str, Any]) -> None:
    """Refuse adapter features headrace does not apply, rather than serve them wrongly."""
    refused = {
        "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas",
        "modules_to_save": "fully trained extra modules",
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out weights",
    }
    for key, what in refused.items():
        if config.get(key):
            raise InvalidArgumentError("path", f"{what} ({key}) are not supported")
    if config.get("bias", "none") != "none":
        raise InvalidArgumentError(
            "path", f"trained biases (bias={config['bias']!r}) are not supported"
        )


def _read_weights(
    directory: Path, rank: int, dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except Exception as exc:  # a missing file, or bytes that are not safetensors
        raise InvalidArgumentError(
            "path", f"cannot read {directory / WEIGHTS_FILE}: {exc}"
        ) from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise InvalidArgumentError("path", f"unexpected tensor {key!r} in {WEIGHTS_FILE}")
        pairs.setdefault(module, {})[part[0]] = tensor.to(dtype)
    weights = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise InvalidArgumentError("path", f"{module} has lora_A or lora_B but not both")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidArgumentError(
                "path",
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not have rank {rank}",
            )
        weights[module] = (a, b)
    if not weights:
        raise InvalidArgumentError("path", f"{WEIGHTS_FILE} holds no LoRA weights")
    return weights
