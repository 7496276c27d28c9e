"""`LoraManager`: one rank's adapters: registered names, a host-memory pool, device slots.

Design note. Three tiers, each keyed by adapter name:

- *registered*: every adapter loaded (at start or by a control call) and not unloaded; only
  its path and rank are kept, so there is no limit on how many.
- *host pool* (``max_cpu_loras``, LRU): adapters read into host memory. One evicted from the
  pool is read from disk again when a step needs it.
- *device slots* (``max_loras``): the stacked tensors every adapted layer reads. The scheduler
  puts at most ``max_loras`` distinct adapters in a step, so `indices_for` always finds a slot
  for each: adapters already in a slot stay, the others take free slots or those of the least
  recently used adapters the step does not need.

Every rank runs the same steps in the same order, so every rank assigns the same slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from headrace.kernels import KernelSet
from headrace.kernels.lora import LoraIndices
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from headrace.worker.layers.moe import SparseMoe
from headrace.worker.layers.weights import ShardId
from headrace.worker.lora.adapter import LoraAdapter, read_adapter
from headrace.worker.lora.layer import LinearLora, LoraBatch
from torch import nn

#: The model's adaptable modules (after q/k/v and gate/up are fused).
ADAPTED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    name: str
    path: Path
    rank: int


class LoraManager:
    def __init__(
        self,
        model: nn.Module,
        packed_modules: Mapping[str, tuple[str, ShardId]],
        kernels: KernelSet,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        #: What every adapted layer reads during a forward pass; `set_batch_indices` writes it.
        self._batch = LoraBatch()
        self.packed_modules = packed_modules
        #: A fused checkpoint module -> its pieces and their rows (Phi-3), from the model.
        self.fused_pieces: Mapping[str, tuple[tuple[str, int], ...]] = getattr(
            model, "fused_pieces", {}
        )
        self.layers: dict[str, LinearLora] = {}
        experts = [name + "." for name, m in model.named_modules() if isinstance(m, SparseMoe)]
        for name, module in model.named_modules():
            if name.startswith(tuple(experts)):
                continue  # a mixture's experts run on a subset of the rows: no adapters
            if name.rpartition(".")[2] in ADAPTED_MODULES and isinstance(
                module, ColumnParallelLinear | RowParallelLinear
            ):
                lora = LinearLora(module, self._batch, kernels, max_loras, max_lora_rank)
                module.attach_delta(lora)
                self.layers[name] = lora
        if not self.layers:
            raise ValueError(f"the model has none of {ADAPTED_MODULES} to adapt")
        self.dtype = next(iter(self.layers.values())).lora_a.dtype
        self.registered: dict[str, AdapterInfo] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        #: Adapter name -> device slot, least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()

    # --- registration --------------------------------------------------------------------

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """The adapter at ``path``, checked against this model; InvalidArgumentError if not."""
        adapter = read_adapter(name, path, self.max_lora_rank, self.dtype)
        adapter = replace(adapter, weights=self._unfused(adapter.weights))
        for module, (a, b) in adapter.weights.items():
            layer, shard_id = self._target(module)
            shapes = None if layer is None else layer.full_shapes(shard_id)
            if shapes is None:
                raise InvalidArgumentError(
                    "path", f"adapter {name!r} targets {module}, which the model lacks"
                )
            if a.shape[1] != shapes[0] or b.shape[0] != shapes[1]:
                raise InvalidArgumentError(
                    "path",
                    f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                    f"{tuple(b.shape)}; the model's module is {shapes[0]} -> {shapes[1]}",
                )
        return adapter

    def add(self, name: str, path: str | Path) -> AdapterInfo:
        """Register and read the adapter (it takes a device slot when a step needs it)."""
        if name in self.registered:
            raise InvalidArgumentError("name", f"adapter {name!r} is already loaded")
        adapter = self.read(name, path)
        info = AdapterInfo(name, adapter.path, adapter.rank)
        self.registered[name] = info
        self._cache(adapter)
        return info

    def remove(self, name: str) -> None:
        self.registered.pop(name, None)
        self._host.pop(name, None)
        self._slots.pop(name, None)  # the slot is free; its contents are overwritten on reuse

    def _unfused(
        self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """An adapter of a module the checkpoint fuses (Phi-3's qkv_proj: the model's
        ``fused_pieces``) as one per piece: A shared, B cut into the pieces' rows."""
        unfused = {}
        for module, (a, b) in weights.items():
            parent, _, leaf = module.rpartition(".")
            pieces = self.fused_pieces.get(leaf)
            if pieces is None or b.shape[0] != sum(rows for _, rows in pieces):
                unfused[module] = (a, b)  # (a misfit is refused by read's shape check)
                continue
            cuts = b.split([rows for _, rows in pieces])
            for (piece, _), b_piece in zip(pieces, cuts, strict=True):
                unfused[f"{parent}.{piece}"] = (a, b_piece)
        return unfused

    def _target(self, module: str) -> tuple[LinearLora | None, ShardId]:
        layer_name, shard_id = self._fused_name(module)
        return self.layers.get(layer_name), shard_id

    def _fused_name(self, module: str) -> tuple[str, ShardId]:
        """The model's (fused) module that a checkpoint module is part of, and which part."""
        parent, _, leaf = module.rpartition(".")
        fused, shard_id = self.packed_modules.get(leaf, (leaf, None))
        return f"{parent}.{fused}", shard_id

    def _cache(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_copy(self, name: str) -> LoraAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # evicted from the pool: read it again
            adapter = self.read(name, self.registered[name].path)
            self._cache(adapter)
        self._host.move_to_end(name)
        return adapter

    # --- steps ---------------------------------------------------------------------------

    def indices_for(
        self, chunks: Sequence[tuple[str | None, int]], device: torch.device
    ) -> LoraIndices:
        """Put the adapters of a batch's chunks ((adapter or None, new tokens) each) in device
        slots; the slot of every row of the batch."""
        slots = self.activate({adapter for adapter, _ in chunks if adapter is not None})
        row_slots: list[int] = []
        for adapter, num_new_tokens in chunks:
            slot = -1 if adapter is None else slots[adapter]
            row_slots.extend([slot] * num_new_tokens)
        return LoraIndices.build(row_slots, self.max_loras, device, self.dtype)

    def set_batch_indices(self, indices: LoraIndices | None) -> None:
        """The slot of each row of the forward pass about to run (from `indices_for`; None:
        no adapter), which every adapted layer reads."""
        self._batch.indices = indices

    def activate(self, names: Iterable[str]) -> dict[str, int]:
        """A device slot for each of ``names`` (at most max_loras of them)."""
        wanted = set(names)
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step; at most {self.max_loras}")
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
        for name in sorted(wanted - self._slots.keys()):
            self._load_slot(name, self._free_slot(wanted))
        return {name: self._slots[name] for name in wanted}

    def _free_slot(self, wanted: set[str]) -> int:
        used = set(self._slots.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(name for name in self._slots if name not in wanted)
        return self._slots.pop(victim)

    @torch.inference_mode()
    def _load_slot(self, name: str, slot: int) -> None:
        adapter = self._host_copy(name)
        per_layer: dict[str, dict[ShardId, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, pair in adapter.weights.items():
            layer_name, shard_id = self._fused_name(module)
            per_layer.setdefault(layer_name, {})[shard_id] = pair
        for layer_name, layer in self.layers.items():
            layer.set_slot(slot, per_layer.get(layer_name, {}), adapter.scaling)
        self._slots[name] = slot


def start_lora(model: nn.Module, kernels: KernelSet, config: EngineConfig) -> LoraManager | None:
    """The model's LoRA manager with the adapters of ``config.lora_modules`` loaded, or None
    when LoRA is off (the layers then run their base weights alone)."""
    if not config.enable_lora:
        return None
    manager = LoraManager(
        model,
        getattr(model, "packed_modules_mapping", {}),
        kernels,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.lora_cpu_capacity,
    )
    for name, path in config.lora_modules:
        manager.add(name, path)
    return manager
