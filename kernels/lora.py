"""Batched LoRA: each row of a batch adds the low-rank delta of its own adapter (or none).

A linear layer with adapters computes y = x Wᵀ + B_s (A_s x) per row, where s is the row's
adapter slot. The delta runs in two steps, as in Punica / S-LoRA:

- shrink: h = x A_sᵀ        [T, in] -> [T, R]   (R: the slots' rank, padded to the maximum)
- expand: y[:, off:off+out] += h B_sᵀ   [T, R] -> [T, out], added in place

Slots hold every adapter in stacked tensors (A: [S, R, in], B: [S, out, R], the adapter's
scaling folded into B), so one call serves any mix of adapters. Rows with slot -1 use the
base model alone: shrink leaves their h zero and expand adds nothing to them.

`LoraIndices` is built once per step and read by every layer: the per-row slots as a tensor
(what a kernel reads), and the same rows grouped by slot (what the reference reads: one
matmul per adapter, never a gathered [T, R, in] copy of the weights).
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

    @classmethod
    def build(cls, row_slots: list[int], device: torch.device) -> LoraIndices:
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
        tensor = torch.from_numpy(slots.astype(np.int32)).to(device)
        return cls(tensor, tuple(groups))

    @property
    def active(self) -> bool:
        """Whether any row uses an adapter."""
        return bool(self.groups)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    lora_a: torch.Tensor,  # [S, R, in]
    indices: LoraIndices,
) -> torch.Tensor:  # [T, R] in x's dtype; zero for base rows
    """h = x A_sᵀ per row."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for group in indices.groups:
        if group.rows is None:
            out = linear(x, lora_a[group.slot])
        else:
            out.index_copy_(
                0, group.rows, linear(x.index_select(0, group.rows), lora_a[group.slot])
            )
    return out


def lora_expand(
    h: torch.Tensor,  # [T, R] (may be a column slice of a wider shrink output)
    lora_b: torch.Tensor,  # [S, out, R]
    indices: LoraIndices,
    y: torch.Tensor,  # [T, Y], Y >= offset + out: updated in place
    offset: int,
) -> None:
    """y[:, offset:offset + out] += h B_sᵀ per row (nothing for base rows)."""
    target = y.narrow(1, offset, lora_b.shape[1])
    for group in indices.groups:
        if group.rows is None:
            target += linear(h, lora_b[group.slot])
        else:
            delta = linear(h.index_select(0, group.rows), lora_b[group.slot])
            target.index_add_(0, group.rows, delta)
