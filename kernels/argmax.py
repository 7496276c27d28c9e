"""A running argmax over column blocks: the greedy LM head's reduction.

A greedy step needs only each row's first maximum, so the LM head can compute its logits a
vocabulary slice at a time and keep a running (value, index) per row: the [rows, vocab]
logits never exist whole (on a CPU they are tens of MB per step, written once, read once and
then freed). Blocks must arrive in ascending column order; the result equals an argmax of
the whole rows (the first maximum; a NaN, as in numpy, counts as the maximum).
"""

from __future__ import annotations

import torch
from headrace.kernels import cpu_ops


class RunningArgmax:
    """Each row's first maximum over the column blocks given to `update` so far."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.best = torch.full((num_rows,), -torch.inf, dtype=torch.float32, device=device)
        self.index = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._native = device.type == "cpu" and cpu_ops.available()

    def update(self, block: torch.Tensor, offset: int) -> None:
        """Fold in ``block``: [rows, C] float32, columns [offset, offset + C)."""
        if self._native:
            cpu_ops.argmax_update(block, offset, self.best, self.index)
            return
        nan = block.isnan()
        # A row's first NaN wins, as in numpy; otherwise the first maximum (torch.max's).
        values, columns = torch.where(nan, torch.inf, block).max(dim=1)
        has_nan = nan.any(dim=1)
        values = torch.where(has_nan, torch.nan, values)
        columns = torch.where(has_nan, nan.int().argmax(dim=1), columns)
        take = ~self.best.isnan() & (values.isnan() | (values > self.best))
        self.best = torch.where(take, values, self.best)
        self.index = torch.where(take, columns + offset, self.index)
