"""Row helpers the sampling stages share: select rows, per-row parameter columns."""

from __future__ import annotations

import torch


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without a copy when rows is every row (rows ascend and are distinct)."""
    return x if len(rows) == x.shape[0] else x[rows]


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """[N, 1] float32, to broadcast one parameter per row over the vocab."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)
