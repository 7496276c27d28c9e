"""Batched LoRA: each row of a batch adds the low-rank delta of its own adapter (or none).

A linear layer with adapters computes y = x Wᵀ + B_s (A_s x) per row, where s is the row's
adapter slot. The delta runs in two steps, as in Punica / S-LoRA:

- shrink: h = x A_sᵀ        [T, in] -> [T, R]   (R: the slots' rank, padded to the maximum)
- expand: y[:, off:off+out] += h B_s    [T, R] -> [T, out], added in place

Slots hold every adapter in stacked tensors (A: [S, R, in], B: [S, R, out], the adapter's
scaling folded into B), so one call serves any mix of adapters. Rows with slot -1 use the
base model alone: shrink leaves their h zero and expand adds nothing to them.

`LoraIndices` is built once per step and read by every layer: the per-row slots as a tensor
(what a kernel reads), the rows grouped by slot, and a row x slot mask (what the reference
reads: dense matmuls against every slot at once, never a gathered [T, R, in] copy of the
weights, and no Python loop over adapters).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from headrace.kernels.precision import linear


@dataclass(frozen=True, slots=True)
class LoraGroup:
    """The rows of one adapter slot."""

    slot: int
    #: [n] int64 row indices; None when the group is every row of the batch.
    rows: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class LoraIndices:
    """Which adapter slot each row of a batch uses, built once per step."""

    #: [T] int32: the slot of each row, -1 for the base model.
    slots: torch.Tensor
    #: Rows grouped by slot, base rows left out.
    groups: tuple[LoraGroup, ...]
    #: [T, S, 1] in the activations' dtype: 1 where the row uses the slot, else 0.
    slot_mask: torch.Tensor

    @classmethod
    def build(
        cls, row_slots: list[int], num_slots: int, device: torch.device, dtype: torch.dtype
    ) -> LoraIndices:
        slots = np.asarray(row_slots, dtype=np.int64)
        groups = []
        for slot in np.unique(slots):
            if slot < 0:
                continue
            if slot == slots[0] and (slots == slot).all():
                groups.append(LoraGroup(int(slot), None))
                continue
            rows = torch.from_numpy(np.flatnonzero(slots == slot)).to(device)
            groups.append(LoraGroup(int(slot), rows))
        mask = np.zeros((len(slots), num_slots, 1), dtype=np.float32)
        used = np.flatnonzero(slots >= 0)
        mask[used, slots[used], 0] = 1.0
        tensor = torch.from_numpy(slots.astype(np.int32)).to(device)
        return cls(tensor, tuple(groups), torch.from_numpy(mask).to(device, dtype))

    @property
    def active(self) -> bool:
        """Whether any row uses an adapter."""
        return bool(self.groups)

    @property
    def single(self) -> LoraGroup | None:
        """The one group, when every row of the batch uses the same adapter."""
        if len(self.groups) == 1 and self.groups[0].rows is None:
            return self.groups[0]
        return None


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    indices: LoraIndices,
) -> torch.Tensor:  # [T, R] in x's dtype; zero for base rows
    """h = x A_sᵀ per row.

    One matmul against every slot's A at once, then each row keeps its own slot's columns
    (the mask zeroes the others, and every column of a base row): S times the shrink's
    flops, which are small next to the base layer's, for no per-adapter Python loop.
    """
    single = indices.single
    if single is not None:
        return linear(x, lora_a[single.slot])
    num_slots, rank, _ = lora_a.shape
    h_all = linear(x, lora_a.flatten(0, 1)).unflatten(1, (num_slots, rank))  # [T, S, R]
    return (h_all * indices.slot_mask).sum(1)


def lora_expand(
    h: torch.Tensor,  # [T, R] (may be a column slice of a wider shrink output)
    lora_b: torch.Tensor,  # [S, R, out]
    indices: LoraIndices,
    y: torch.Tensor,  # [T, Y], Y >= offset + out: updated in place
    offset: int,
) -> None:
    """y[:, offset:offset + out] += h B_s per row (nothing for base rows).

    Each row's h is placed in its slot's block of an [T, S * R] operand (zeros elsewhere),
    so one matmul against every slot's B, stacked [S * R, out], applies each row's own B.
    """
    target = y.narrow(1, offset, lora_b.shape[2])
    single = indices.single
    if single is not None:
        target.addmm_(h, lora_b[single.slot].to(h.dtype))
        return
    spread = (h.unsqueeze(1) * indices.slot_mask).flatten(1)  # [T, S * R]
    target.addmm_(spread, lora_b.flatten(0, 1).to(h.dtype))
