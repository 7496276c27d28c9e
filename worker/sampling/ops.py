"""Row helpers the sampling stages share: select rows, argmax, per-row parameter columns."""

from __future__ import annotations

import numpy as np
import torch


def select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without a copy when rows is every row (rows ascend and are distinct)."""
    return x if len(rows) == x.shape[0] else x[rows]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum; on CPU numpy's SIMD argmax is several times torch's."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1))
    return x.argmax(dim=-1)


def column(values: list[float], device: torch.device) -> torch.Tensor:
    """[N, 1] float32, to broadcast one parameter per row over the vocab."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(-1, 1)
