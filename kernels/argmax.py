"""A running argmax over column blocks: the greedy LM head's reduction.

A greedy step needs only each row's first maximum, so the LM head can compute its logits a
vocabulary slice at a time and keep a running (value, index) per row: the [rows, vocab]
logits never exist whole (on a CPU they are tens of MB per step, written once, read once and
then freed). Blocks must arrive in ascending column order; the result equals an argmax of
the whole rows (the first maximum; a NaN, as in numpy, counts as the maximum).

`argmax_update` here is the torch reference of the kernel sets' `argmax_update` (the CPU
backend's is C).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from headrace.kernels.backend import KernelSet


class RunningArgmax:
    """Each row's first maximum over the column blocks given to `update` so far."""

    def __init__(self, num_rows: int, device: torch.device, kernels: KernelSet | None) -> None:
        """``kernels``: the backend whose `argmax_update` folds the blocks in (None: torch's)."""
        self.best = torch.full((num_rows,), -torch.inf, dtype=torch.float32, device=device)
        self.index = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._update = argmax_update if kernels is None else kernels.argmax_update

    def update(self, block: torch.Tensor, offset: int) -> None:
        """Fold in ``block``: [rows, C] float32, columns [offset, offset + C)."""
        self._update(block, offset, self.best, self.index)


def argmax_update(
    x: torch.Tensor,  # [N, C] float32: columns [offset, offset + C) of every row
    offset: int,
    best: torch.Tensor,  # [N] float32, updated in place
    index: torch.Tensor,  # [N] int64, updated in place
) -> None:
    """A running argmax over column blocks in ascending order: after the last block, index
    holds each row's first maximum over all columns (as `argmax` of the whole rows)."""
    nan = x.isnan()
    # A row's first NaN wins, as in numpy; otherwise the first maximum (torch.max's).
    values, columns = torch.where(nan, torch.inf, x).max(dim=1)
    has_nan = nan.any(dim=1)
    values = torch.where(has_nan, torch.nan, values)
    columns = torch.where(has_nan, nan.int().argmax(dim=1), columns)
    take = ~best.isnan() & (values.isnan() | (values > best))
    best.copy_(torch.where(take, values, best))
    index.copy_(torch.where(take, columns + offset, index))
