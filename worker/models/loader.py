"""Load a Hugging Face safetensors checkpoint into headrace's (fused, sharded) parameters.

Tensors are streamed one at a time with `safetensors.safe_open`, each as a `CheckpointTensor`
that reads nothing until asked. Each checkpoint name is mapped onto a parameter (renaming the
projections a model fuses, e.g. ``q_proj`` -> ``qkv_proj`` shard "q"), and that parameter's
own ``weight_loader`` narrows the tensor to this rank's slice, reads only that slice from
disk and converts the dtype; a tensor nothing takes is never read. So a rank reads about
1 / tensor_parallel_size of the sharded weights, and peak host memory is one slice.

A checkpoint that leaves a parameter (or one piece of a fused one) unfilled, or holds a
tensor nothing takes, is refused with the names.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.layers.weights import (
    CheckpointTensor,
    LoadedTensor,
    ShardId,
    shard_ids_of,
    weight_loader_of,
)
from headrace.worker.models.compressed_tensors import compressed_tensors, read_scheme
from safetensors import safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: How many names an error message lists before eliding the rest.
_MAX_NAMES_SHOWN = 10


class CheckpointError(InvalidArgumentError):
    """The checkpoint's tensors do not fit the model (missing, unexpected, misshapen)."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


def checkpoint_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or the single file."""
    index = checkpoint_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
    single = checkpoint_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {checkpoint_dir}")


def iter_checkpoint(checkpoint_dir: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, unread tensor) for every tensor of the checkpoint.

    Each file stays open only while its tensors are being yielded, so a tensor must be read
    before the iterator moves on (as `load_weights` does)."""
    for path in checkpoint_files(checkpoint_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, CheckpointTensor.whole(name, f.get_slice(name))


def iter_weights(checkpoint_dir: Path) -> Iterator[tuple[str, LoadedTensor]]:
    """`iter_checkpoint`, with a compressed-tensors checkpoint's quantized layers joined into
    `QuantizedWeight`s (`headrace.worker.models.compressed_tensors`)."""
    scheme = read_scheme(checkpoint_dir)
    if scheme is None:
        yield from iter_checkpoint(checkpoint_dir)
    else:
        yield from compressed_tensors(iter_checkpoint(checkpoint_dir), scheme)


def load_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, LoadedTensor]],
    packed_modules: Mapping[str, tuple[str, ShardId]],
    ignored: Collection[str] = (),
    complete: bool = True,
) -> None:
    """Fill every parameter of ``model`` from ``tensors`` (with ``complete=False``, only
    those the tensors name: a part of an update already checked to be whole).

    ``packed_modules`` maps a checkpoint module name (``q_proj``) to the fused module that
    holds it and its shard id (``("qkv_proj", "q")``); ``ignored`` names checkpoint tensors
    to skip (e.g. ``lm_head.weight`` when the model ties it to the embedding). A skipped or
    unexpected `CheckpointTensor` is never read.
    """
    params = dict(model.named_parameters())
    expected = {(name, shard) for name, param in params.items() for shard in shard_ids_of(param)}
    filled: set[tuple[str, ShardId]] = set()
    unexpected: list[str] = []
    for name, tensor in tensors:
        if name in ignored or name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints saved the rotary buffer; headrace recomputes it
        target, shard_id = _param_name(name, packed_modules)
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        try:
            weight_loader_of(param)(param, tensor, shard_id)
        except ValueError as exc:
            raise CheckpointError(f"{name}: {exc}") from exc
        filled.add((target, shard_id))
    _check_complete(expected - filled if complete else set(), unexpected, packed_modules)


def _param_name(
    name: str, packed_modules: Mapping[str, tuple[str, ShardId]]
) -> tuple[str, ShardId]:
    """``model.layers.0.self_attn.q_proj.weight`` -> (``...self_attn.qkv_proj.weight``, "q")."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed_modules:
        fused, shard_id = packed_modules[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard_id
    return name, None


def _check_complete(
    missing: set[tuple[str, ShardId]],
    unexpected: list[str],
    packed_modules: Mapping[str, tuple[str, ShardId]],
) -> None:
    problems = []
    if missing:
        names = sorted(_checkpoint_name(target, shard, packed_modules) for target, shard in missing)
        problems.append(f"missing weights: {_join(names)}")
    if unexpected:
        problems.append(f"unexpected weights: {_join(sorted(unexpected))}")
    if problems:
        raise CheckpointError("; ".join(problems))


def _checkpoint_name(
    target: str, shard_id: ShardId, packed_modules: Mapping[str, tuple[str, ShardId]]
) -> str:
    """The checkpoint's name for one piece of a parameter, so errors speak HF names."""
    if shard_id is None:
        return target
    parts = target.split(".")
    for original, (fused, shard) in packed_modules.items():
        if parts[-2] == fused and shard == shard_id:
            return ".".join([*parts[:-2], original, parts[-1]])
    return f"{target}[{shard_id}]"


def _join(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    extra = len(names) - _MAX_NAMES_SHOWN
    return f"{shown} (and {extra} more)" if extra > 0 else shown
